"""Environment check: [OK]/[FAIL] per required package and per capability.

Run from the repository root: `python setup/check_env.py`. Exits 1 when a required package is
missing or too old (capabilities such as a GPU or flash-attn are reported, never required).
"""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path

REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*([^;#]*)")


def read_requirements(path: Path) -> list[tuple[str, str]]:
    """(name, specifier) for each requirement line; comments and options are skipped."""
    found = []
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        match = REQUIREMENT.match(line)
        if match:
            found.append((match.group(1), match.group(3).strip()))
    return found


def check_requirement(name: str, specifier: str) -> tuple[bool, str]:
    try:
        version = metadata.version(name)
    except metadata.PackageNotFoundError:
        return False, f"not installed (need {name}{specifier}): pip install -r requirements.txt"
    if not specifier:
        return True, version
    try:
        from packaging.specifiers import SpecifierSet
    except ImportError:
        return True, f"{version} (install `packaging` to check {specifier})"
    if SpecifierSet(specifier).contains(version, prereleases=True):
        return True, version
    return False, f"{version} does not satisfy {specifier}: pip install -U -r requirements.txt"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    root = Path(__file__).resolve().parent.parent
    parser.add_argument("--requirements", type=Path, default=root / "requirements.txt")
    args = parser.parse_args(argv)

    failed = 0
    print(f"Python {sys.version.split()[0]} ({sys.executable})")
    if sys.version_info < (3, 10):  # noqa: UP036 - this script is what tells users their Python is too old
        print("[FAIL] python: the course needs Python 3.10 or newer")
        failed += 1
    print(f"Required packages ({args.requirements.name}):")
    for name, spec in read_requirements(args.requirements):
        ok, detail = check_requirement(name, spec)
        failed += not ok
        print(f"  [{'OK' if ok else 'FAIL'}] {name}: {detail}")

    print("Course helpers and capabilities:")
    try:
        from helpers.system.env import capability_checks, environment_report
    except ImportError as err:
        print(f"  [FAIL] helpers: not importable ({err}): run `pip install -e .` in the repository root")
        return 1
    print("  [OK] helpers: importable")
    for ok, what, detail in capability_checks(environment_report()):
        print(f"  [{'OK' if ok else '--'}] {what}: {detail}")
    print("All required packages are present." if not failed else f"{failed} problem(s) found.")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
