"""The version-dependent tests in a fresh environment on the oldest or on the newest versions the project allows.

    python3 .ci/matrix.py lowest   # every dependency at the lower bound pyproject.toml declares (`>=`)
    python3 .ci/matrix.py newest   # what pip picks today for a new user (`--upgrade`: the newest of everything)

`lowest` keeps the declared bounds true: if a test needs something newer, the bound must rise. Each environment
is a virtual environment in `.venv-<name>` beside the course's own `.venv` (kept, so a rerun only tests again).
Only the tests marked `versions` run here (torch.compile, DTensor and pipelining, torchao, transformers, FlexAttention,
the Triton interpreter, torch's private APIs; tests/conftest.py assigns the marker): `make test` ran every test in
the main environment already. A leg whose resolved versions equal the main environment's is skipped.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("lowest", "newest")
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
WORKERS = str(max(1, min(4, len(os.sched_getaffinity(0)))))
PYTEST = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--durations=25", "--timeout=900"]
NO_TESTS = 5  # pytest's exit status when the selection is empty


def lower_bounds(requirements: list[str]) -> list[str]:
    """`name==version` for every `name>=version` requirement (markers kept)."""
    pins = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        found = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*>=\s*([^,\s]+)\s*", spec)
        if found:
            pins.append(f"{found[1]}=={found[2]}" + (f"; {marker.strip()}" if marker else ""))
    return pins


def run(command: list[str], **kwargs) -> None:
    print("+", " ".join(command), flush=True)
    subprocess.run(command, check=True, cwd=ROOT, **kwargs)


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def resolved_versions(python: str, install: list[str]) -> dict[str, str]:
    """What `pip install ARGS` would install in an empty environment, without installing it (pip's report)."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        run([python, "-m", "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report",
             str(report), *install])
        items = json.loads(report.read_text())["install"]
    return {canonical(i["metadata"]["name"]): i["metadata"]["version"] for i in items if not i.get("is_direct")}


def main_versions() -> dict[str, str] | None:
    """The packages of the course's own environment (`make test`'s), or None when it does not exist."""
    if not MAIN_PYTHON.exists():
        return None
    listed = subprocess.run([str(MAIN_PYTHON), "-m", "pip", "list", "--format", "json"], check=True,
                            capture_output=True, text=True, cwd=ROOT).stdout
    return {canonical(p["name"]): p["version"] for p in json.loads(listed)}


def install_args(variant: str, venv: Path) -> list[str]:
    if variant == "lowest":
        runtime = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
        dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
        constraints = venv / "lower-bounds.txt"
        constraints.write_text("\n".join(lower_bounds([r for r in runtime if r] + dev)) + "\n")
        return ["-c", str(constraints), "-r", "requirements.txt", "-e", ".[dev]"]
    return ["--upgrade", "torch", "-r", "requirements.txt", "-e", ".[dev]"]


def pytest(python: str, marker: str, *options: str) -> None:
    command = [python, *PYTEST, *options, "-m", marker]
    print("+", " ".join(command), flush=True)
    status = subprocess.run(command, cwd=ROOT).returncode
    if status not in (0, NO_TESTS):
        raise subprocess.CalledProcessError(status, command)


def main(variant: str) -> int:
    if variant not in VARIANTS:
        print(f"usage: python3 .ci/matrix.py {{{','.join(VARIANTS)}}}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    venv = ROOT / f".venv-{variant}"
    python = str(venv / "bin" / "python")
    if not venv.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    install = install_args(variant, venv)
    resolved, main_env = resolved_versions(python, install), main_versions()
    if main_env is not None and all(main_env.get(name) == version for name, version in resolved.items()):
        print(f"{variant}: skipped, its {len(resolved)} resolved packages are the main environment's versions")
        return 0
    run([python, "-m", "pip", "install", "--quiet", *install])
    run([python, "-c", "import torch, transformers, torchao, triton; "
                       "print(torch.__version__, transformers.__version__, torchao.__version__, triton.__version__)"])
    installed = time.perf_counter()
    pytest(python, "versions and not serial", "-n", WORKERS, "--dist", "loadgroup")
    pytest(python, "versions and serial")  # alone: they measure time or memory
    print(f"{variant}: installed in {installed - start:.0f} s, tested in {time.perf_counter() - installed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) == 2 else ""))
