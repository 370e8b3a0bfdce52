"""The unit tests (notebooks excluded) in a fresh environment on the oldest or on the newest torch the project allows.

    python3 .ci/matrix.py lowest   # every dependency at the lower bound pyproject.toml declares (`>=`)
    python3 .ci/matrix.py newest   # what pip picks today for a new user (`--upgrade`: the newest of everything)

`lowest` keeps the declared bounds true: if a test needs something newer, the bound must rise. Each environment
is a virtual environment in `.venv-<name>` beside the course's own `.venv` (kept, so a rerun only tests again).
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = ("lowest", "newest")


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


def main(variant: str) -> int:
    if variant not in VARIANTS:
        print(f"usage: python3 .ci/matrix.py {{{','.join(VARIANTS)}}}", file=sys.stderr)
        return 2
    start = time.perf_counter()
    venv = ROOT / f".venv-{variant}"
    python = str(venv / "bin" / "python")
    if not venv.exists():
        run([sys.executable, "-m", "venv", str(venv)])
    pip = [python, "-m", "pip", "install", "--quiet"]
    if variant == "lowest":
        runtime = [line.split("#")[0].strip() for line in (ROOT / "requirements.txt").read_text().splitlines()]
        dev = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["dev"]
        constraints = venv / "lower-bounds.txt"
        constraints.write_text("\n".join(lower_bounds([r for r in runtime if r] + dev)) + "\n")
        run([*pip, "-c", str(constraints), "-r", "requirements.txt", "-e", ".[dev]"])
    else:
        run([*pip, "--upgrade", "torch", "-r", "requirements.txt", "-e", ".[dev]"])
    run([python, "-c", "import torch, transformers, torchao, triton; "
                       "print(torch.__version__, transformers.__version__, torchao.__version__, triton.__version__)"])
    installed = time.perf_counter()
    run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--ignore=tests/test_notebooks.py"])
    print(f"{variant}: installed in {installed - start:.0f} s, tested in {time.perf_counter() - installed:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) == 2 else ""))
