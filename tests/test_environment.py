"""The suite's outcome does not depend on the caller's shell: part of it runs in a fresh pytest with the variables a
learner may export (the course's own, the hubs', torch's) set to odd values, and must pass as it does without them.
"""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# What a learner's shell may export, each at a value that changes what a test sees if it inherits it.
ODD_ENVIRONMENT = {
    "COURSE_SMOKE": "1",  # the README's smoke switch, kept from `COURSE_SMOKE=1 make course`
    "COURSE_CACHE_DIR": "/nonexistent/course-cache",
    "HF_HUB_OFFLINE": "1",  # what Hugging Face tells offline users to set
    "TRANSFORMERS_OFFLINE": "1",
    "HF_HOME": "/nonexistent/hf-home",
    "HF_ENDPOINT": "http://127.0.0.1:9",
    "TIKTOKEN_CACHE_DIR": "/nonexistent/tiktoken",
    "CUDA_VISIBLE_DEVICES": "",
    "OMP_NUM_THREADS": "3",
    "TORCH_LOGS": "+dynamo",
    "PYTORCH_NO_CUDA_MEMORY_CACHING": "1",
    "TQDM_DISABLE": "1",
}
# The tests that read these: the recording's scale and threads, the hub's offline answers, the tokenizer's files,
# the cache folder, the device and scale choice, the command line's scaled defaults.
SUBSET = ["tests/test_record.py", "tests/test_weights.py", "tests/test_tokenizer.py", "tests/test_files.py",
          "tests/test_device.py", "tests/test_env.py", "tests/test_cli.py"]


def test_the_suite_passes_whatever_the_shell_exports(python_process):
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}, **ODD_ENVIRONMENT}
    done = python_process("-m", "pytest", "-q", "-p", "no:cacheprovider", "-m",
                          "not (subprocess or slow or serial or notebook or distributed or compile)", *SUBSET,
                          cwd=ROOT, env=env, timeout=600)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]
