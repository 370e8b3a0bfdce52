"""Command line: `python -m helpers env [--json]`, `calibrate`, `bench-attention`, `flops`, `bench-load`,
`bench-serve`, `bench-decode`, `bench-train`, `serve`, `load-test`, `serve-race`, `run-notebooks`, `record`,
`sync-bootstrap`; `python -m helpers COMMAND --help` for each. Each command is defined in the module of what it drives
(`helpers.system.cli.Command`)."""

from __future__ import annotations

import sys

from .measure import (
    attention_bench,
    calibration,
    decode_bench,
    flops,
    load_bench,
    load_test,
    serving_bench,
    serving_race,
    train_bench,
)
from .notebooks import RECORD_COMMAND, RUN_COMMAND, SYNC_COMMAND
from .serving import server
from .system import env
from .system.cli import build_parser

COMMANDS = [env.COMMAND, calibration.COMMAND, attention_bench.COMMAND, flops.COMMAND, load_bench.COMMAND,
            serving_bench.COMMAND, decode_bench.COMMAND, train_bench.COMMAND, server.COMMAND, load_test.COMMAND,
            serving_race.COMMAND, RUN_COMMAND, RECORD_COMMAND, SYNC_COMMAND]


def main(argv: list[str] | None = None) -> int:
    args = build_parser(COMMANDS, __doc__).parse_args(argv)
    return args.command.run(args)


if __name__ == "__main__":
    sys.exit(main())
