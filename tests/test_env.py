import json
import re
from pathlib import Path

import pytest
import torch

from helpers.system.env import usable_sdpa_backends
from helpers.system.optional import MissingOptionalPackage, require, version_of

CHECK = str(Path(__file__).resolve().parents[1] / "setup" / "check_env.py")


def test_env_json_has_the_documented_keys(python_process):
    out = python_process("-m", "helpers", "env", "--json", check=True).stdout
    report = json.loads(out)
    assert {"python", "torch", "device", "bf16", "flash_attn", "sdpa_backends", "cpu_threads"} <= set(report)
    assert report["torch"] == torch.__version__
    assert report["flash_attn"] == version_of("flash_attn")
    text = python_process("-m", "helpers", "env", check=True).stdout
    assert re.search(rf"^torch\s+: {re.escape(torch.__version__)}$", text, re.M)


def test_math_backend_always_runs_and_mem_efficient_never_on_cpu():
    backends = usable_sdpa_backends(torch.device("cpu"), torch.float32)
    assert "math" in backends and "efficient_attention" not in backends


def test_missing_optional_package_says_how_to_install():
    if version_of("flash_attn") is not None:
        pytest.skip("flash-attn is installed here")
    with pytest.raises(MissingOptionalPackage, match="pip install flash-attn --no-build-isolation"):
        require("flash_attn", "attn_implementation='flash_attention_2'")
    assert require("json", "a test").dumps([1]) == "[1]"


def test_setup_check_passes_here_and_fails_on_a_missing_requirement(python_process, tmp_path):
    ok = python_process(CHECK)
    assert ok.returncode == 0, ok.stdout
    assert "[OK] torch" in ok.stdout
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("torch>=2.0\nno-such-package-xyz>=1.0\nnumpy>=999\n")
    bad = python_process(CHECK, "--requirements", reqs)
    assert bad.returncode == 1
    assert "[FAIL] no-such-package-xyz: not installed" in bad.stdout
    assert "[FAIL] numpy" in bad.stdout and "[OK] torch" in bad.stdout
