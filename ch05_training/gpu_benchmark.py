"""The training-speed ladder of GPT-2 small (context 1024) on one GPU, in a few minutes; writes JSON and a plot.

    python ch05_training/gpu_benchmark.py                 # on a CUDA GPU: results/train_speed_<gpu>.json + .png
    python ch05_training/gpu_benchmark.py --smoke --out /tmp/x   # the same code path, tiny, on CPU

Each rung adds one optimisation to the training step of the rung before (TF32, fused AdamW, bf16 autocast, SDPA,
vocabulary padded to 64, a larger batch by accumulation, torch.compile); tokens/s and MFU against the GPU's
datasheet peak at each rung, then our best rung against transformers' GPT2LMHeadModel with the same settings
(eager and compiled). Notebook 04 shows the results.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

from helpers.measure.train_bench import bench_train, format_report, plot_ladder  # noqa: E402
from helpers.system.env import environment_report  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script itself")
    parser.add_argument("--batch", type=int, default=32, help="sequences of 1024 tokens per micro-batch (default 32)")
    parser.add_argument("--steps", type=int, default=10, help="timed optimizer steps per rung (default 10)")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per step on that rung (default 4)")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; use --smoke to check the script on CPU")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.smoke:
        model, batch, ctx, steps, warmup, accumulation = "gpt-smoke", 2, 64, 2, 1, 2
    else:
        model, ctx, warmup = "gpt2-small", 1024, 3
        batch, steps, accumulation = args.batch, args.steps, args.accumulation
    env = environment_report()
    started = time.perf_counter()
    report = bench_train(model, batch, ctx, steps, warmup, accumulation, device, progress=True)
    report |= {"smoke": args.smoke, "cuda": torch.version.cuda, "flash_attn": env["flash_attn"],
               "seconds": round(time.perf_counter() - started, 1)}
    if device == "cuda":
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    print(format_report(report))

    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", report["device_name"].lower()).strip("-")
    (args.out / f"train_speed_{slug}.json").write_text(json.dumps(report, indent=1))
    plot_ladder(report).savefig(args.out / f"train_speed_{slug}.png", dpi=120)
    print(f"wrote {args.out}/train_speed_{slug}.json and .png in {report['seconds']} s")


if __name__ == "__main__":
    main()
