"""Command line: `python -m helpers env [--json]`, `run-notebooks`, `sync-bootstrap`."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _env(args: argparse.Namespace) -> int:
    from .env import environment_report, format_report

    report = environment_report()
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


def _run_notebooks(args: argparse.Namespace) -> int:
    from .notebooks import ROOT, execute_notebook, find_notebooks
    from .scale import smoke_requested

    paths = [Path(p) for p in args.notebooks] or find_notebooks()
    smoke = args.smoke or smoke_requested()
    out = Path(args.out)
    print(f"executing {len(paths)} notebook(s) at {'smoke' if smoke else 'default'} scale into {out}/")
    failed = 0
    for path in paths:
        rel = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else Path(path.name)
        run = execute_notebook(path, out / rel, smoke=smoke, timeout=args.timeout)
        failed += run.error is not None
        print(f"{'FAIL' if run.error else 'ok':>4}  {run.seconds:7.1f} s  {rel}", flush=True)
        if run.error:
            print(run.error[-3000:], file=sys.stderr)
    print(f"{len(paths) - failed} passed, {failed} failed")
    return 1 if failed else 0


def _sync_bootstrap(args: argparse.Namespace) -> int:
    from .notebooks import find_notebooks, sync_bootstrap

    for path in find_notebooks():
        if sync_bootstrap(path):
            print(f"updated {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m helpers", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    env = commands.add_parser("env", help="print the environment report")
    env.add_argument("--json", action="store_true", help="one JSON object instead of text")
    env.set_defaults(func=_env)

    run = commands.add_parser("run-notebooks", help="execute notebooks headless into a report folder")
    run.add_argument("notebooks", nargs="*", help="notebooks to run (default: every chapter's)")
    run.add_argument("--out", default="reports", help="folder for the executed copies (default: reports)")
    run.add_argument("--smoke", action="store_true", help="smoke scale (same as COURSE_SMOKE=1)")
    run.add_argument("--timeout", type=int, default=900, help="seconds allowed per cell")
    run.set_defaults(func=_run_notebooks)

    sync = commands.add_parser("sync-bootstrap", help="write the bootstrap cell into every notebook")
    sync.set_defaults(func=_sync_bootstrap)

    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
