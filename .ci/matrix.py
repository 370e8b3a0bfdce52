"""The version-dependent tests in a fresh environment on the oldest or on the newest versions the project allows.

    python3 .ci/matrix.py lowest   # every dependency at the lower bound pyproject.toml declares (`>=`)
    python3 .ci/matrix.py newest   # what pip picks today for a new user (`--upgrade`: the newest of everything)

`lowest` keeps the declared bounds true: if a test needs something newer, the bound must rise. Each environment
is a virtual environment in `.venv-<name>` beside the course's own `.venv` (kept, so a rerun only tests again).
Only the tests marked `versions` run here (torch.compile, DTensor and pipelining, torchao, transformers, FlexAttention,
the Triton interpreter, torch's private APIs; tests/conftest.py assigns the marker): `make test` ran every test in
the main environment already. A leg whose versions equal the main environment's is skipped.

    python3 .ci/matrix.py lowest --discard   # CI: remove the environment after its tests, freeing the disk

Disk: pip takes a CUDA build of torch from PyPI (no CPU build of it is there), about 5-7 GB unpacked, and holds
the downloaded wheels until the install ends. A leg checks the free space first: where the disk cannot hold it, it
says so and is skipped (the disk, not the code, is short; `make test` has run every test).
"""

from __future__ import annotations

import json
import os
import re
import shutil
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
# Free disk a leg needs at its peak (downloaded wheels + the environment), measured on x86_64 Linux, Python 3.11:
# lowest 11.0 GB (torch 2.8.0+cu128 downloaded, 7.1 GB unpacked), newest 5.5 GB (torch 2.14.1+cu130).
DISK_NEEDED_GB = {"lowest": 12, "newest": 7}


def lower_bounds(requirements: list[str]) -> list[str]:
    """`name==version` for every `name>=version` requirement, with or without an upper bound (markers kept)."""
    pins = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        found = re.fullmatch(r"\s*([A-Za-z0-9._-]+)\s*>=\s*([^,\s]+)\s*(?:,\s*<\s*[^,\s]+\s*)?", spec)
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


def leg_versions(variant: str, python: str, install: list[str], venv: Path) -> dict[str, str]:
    """The versions the leg would test: the lower bounds themselves for `lowest` (resolving them would download
    every wheel once more), what pip resolves today for `newest`."""
    if variant == "lowest":
        pins = (line.split(";")[0].partition("==") for line in (venv / "lower-bounds.txt").read_text().splitlines())
        return {canonical(name.strip()): version.strip() for name, _, version in pins if version}
    return resolved_versions(python, install)


def disk_shortfall(variant: str) -> str | None:
    """Why the leg's install could not finish on this disk, or None when the free space covers its measured peak."""
    free_gb = shutil.disk_usage(ROOT).free / 1e9
    if free_gb >= DISK_NEEDED_GB[variant]:
        return None
    return (f"{variant}: SKIPPED, {free_gb:.1f} GB free on this disk and the leg needs about "
            f"{DISK_NEEDED_GB[variant]} GB (a CUDA build of torch from PyPI): free disk space to run it")


def main(argv: list[str]) -> int:
    variant, *options = argv or [""]
    if variant not in VARIANTS or options not in ([], ["--discard"]):
        print(f"usage: python3 .ci/matrix.py {{{','.join(VARIANTS)}}} [--discard]", file=sys.stderr)
        return 2
    start = time.perf_counter()
    venv = ROOT / f".venv-{variant}"
    python = str(venv / "bin" / "python")
    if not venv.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    install = install_args(variant, venv)
    versions, main_env = leg_versions(variant, python, install, venv), main_versions()
    if main_env is not None and all(main_env.get(name) == version for name, version in versions.items()):
        print(f"{variant}: skipped, its {len(versions)} packages are the main environment's versions")
        return 0
    shortfall = disk_shortfall(variant)
    if shortfall:
        print(shortfall, file=sys.stderr)
        return 0
    try:
        install_and_test(variant, python, install, start)
    finally:
        if options:
            shutil.rmtree(venv)
            print(f"{variant}: removed {venv.name}/")
    return 0


def install_and_test(variant: str, python: str, install: list[str], start: float) -> None:
    run([python, "-m", "pip", "install", "--quiet", "--no-cache-dir", *install])
    run([python, "-c", "import torch, transformers, torchao, triton; "
                       "print(torch.__version__, transformers.__version__, torchao.__version__, triton.__version__)"])
    installed = time.perf_counter()
    pytest(python, "versions and not serial", "-n", WORKERS, "--dist", "loadgroup")
    pytest(python, "versions and serial")  # alone: they measure time or memory
    print(f"{variant}: installed in {installed - start:.0f} s, tested in {time.perf_counter() - installed:.0f} s")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
