"""`python -m helpers bench-train`: climb the training-speed ladder for a preset (`helpers.measure.train_ladder`,
its rungs in `train_rungs`), race transformers' GPT-2 (`train_peer`), and print the report (`train_report`)."""

from __future__ import annotations

import json
from collections.abc import Callable

from ..model.config import PRESETS
from ..system.args import positive_int
from ..system.cli import Command, add_device, add_json, add_scaled, fill_scale_defaults
from .train_ladder import Ladder
from .train_peer import compare_with_transformers
from .train_report import format_report
from .train_rungs import LADDER


def bench_train(model: str, batch: int, ctx: int, steps: int = 5, warmup: int = 2, accumulation: int = 4,
                device: str | None = None, until: str | None = None, progress: bool = False,
                on_report: Callable[[dict], None] | None = None) -> dict:
    """Climb the ladder for a preset and race transformers: the report of `python -m helpers bench-train`.

    on_report: called with the report so far after each rung and after the race (to save it as it grows).
    """
    if model not in PRESETS:
        raise ValueError(f"unknown model {model!r}; valid presets: {', '.join(PRESETS)}")
    ladder = Ladder(PRESETS[model], batch, ctx, steps, warmup, accumulation, device, until, model_name=model)
    ladder.climb(progress, on_rung=None if on_report is None else lambda: on_report(ladder.report()))
    compare_with_transformers(ladder)
    if on_report is not None:
        on_report(ladder.report())
    return ladder.report()


def _arguments(parser) -> None:
    add_scaled(parser, COMMAND, "model", "preset, random weights", choices=list(PRESETS), type=str)
    add_scaled(parser, COMMAND, "batch", "sequences per micro-batch")
    add_scaled(parser, COMMAND, "ctx", "tokens per sequence, at most the preset's context")
    add_scaled(parser, COMMAND, "steps", "timed optimizer steps per rung; median and IQR")
    parser.add_argument("--warmup", type=positive_int, default=2,
                        help="untimed steps first, compilation included (default: 2)")
    parser.add_argument("--accumulation", type=positive_int, default=4,
                        help="micro-batches per optimizer step on the accumulation rung (default: 4)")
    parser.add_argument("--until", choices=LADDER, help="stop after this rung (e.g. accumulation: no torch.compile)")
    add_device(parser)
    add_json(parser, "a table")


def _run(args) -> int:
    ctx_given = args.ctx is not None
    device = fill_scale_defaults(args, COMMAND)
    context = PRESETS[args.model].context_length
    ctx = args.ctx if ctx_given else min(args.ctx, context)
    if ctx > context:
        args.command_parser.error(f"--ctx {ctx} is longer than {args.model}'s context length; pass --ctx "
                                  f"{context} or less")
    try:
        report = bench_train(args.model, args.batch, ctx, args.steps, args.warmup, args.accumulation, device,
                             args.until, progress=True)
    except ValueError as err:  # sizes that cannot run: say which flag to change, no traceback
        args.command_parser.error(str(err))
    print(json.dumps(report, indent=2) if args.json else format_report(report))
    return 0


COMMAND = Command("bench-train", "the training-speed ladder (tokens/s, MFU) and transformers' GPT-2", _arguments, _run,
                  scale_defaults={"smoke": dict(model="gpt-smoke", batch=2, ctx=64, steps=2),
                                  "cpu": dict(model="gpt-cpu", batch=4, ctx=128, steps=5),
                                  "gpu": dict(model="gpt2-small", batch=8, ctx=1024, steps=10)})
