"""The training-speed ladder of GPT-2 small (context 1024) on one GPU, in a few minutes; writes JSON and a plot.

    python ch05_training/gpu_benchmark.py                 # on a CUDA GPU: results/train_speed_<gpu>.json + .png
    python ch05_training/gpu_benchmark.py --smoke --out /tmp/x   # the same code path, tiny, on CPU

Each rung adds one optimisation to the training step of the rung before (TF32, fused AdamW, bf16 autocast, SDPA,
vocabulary padded to 64, a larger batch by accumulation, torch.compile); tokens/s and MFU against the GPU's
datasheet peak at each rung, then our best rung against transformers' GPT2LMHeadModel with the same settings
(eager and compiled). Notebook 04 shows the results.

The batch (unless --batch) is the largest power of two, up to 32, at which the hungriest rung (the fp32 baseline)
fits this GPU, found by trying. A rung that fails (out of memory, say) is recorded with its error and the ladder
goes on; the JSON is rewritten after every rung, so a run that stops early keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from collections.abc import Callable
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import torch  # noqa: E402

from helpers.measure.batch_size import (  # noqa: E402
    BatchSizeError,
    cuda_step_fits,
    largest_batch_size,
    make_training_step,
)
from helpers.measure.results import results_path, save_figure, save_json  # noqa: E402
from helpers.measure.train_bench import bench_train  # noqa: E402
from helpers.measure.train_report import format_report, plot_ladder  # noqa: E402
from helpers.model.config import PRESETS  # noqa: E402
from helpers.model.gpt import GPT  # noqa: E402
from helpers.system.args import positive_int  # noqa: E402
from helpers.system.device import detect_capabilities  # noqa: E402
from helpers.system.env import environment_report  # noqa: E402

MAX_DEFAULT_BATCH = 32
KEPT_BYTES_PER_PARAMETER = 12  # fp32 weights and AdamW's two moments (gradients are freed after every step)


def default_batch(fits: Callable[[int], bool], limit: int = MAX_DEFAULT_BATCH) -> int:
    """The largest power of two up to `limit` for which `fits(batch)`: headroom below the largest batch that fits,
    and round sizes that compare across GPUs."""
    return 1 << (largest_batch_size(fits, limit=limit).batch_size.bit_length() - 1)


def baseline_batch(model: str, ctx: int, device: torch.device) -> int:
    """`default_batch` on this GPU for the ladder's hungriest rung, the fp32 baseline (textbook attention, fp32
    activations, PyTorch's default AdamW), tried next to the model and optimizer of the best rung so far, which the
    ladder keeps while it climbs. The memory of the trials is handed back."""
    torch.manual_seed(0)
    gpt = GPT(dataclasses.replace(PRESETS[model], dropout=0.0), attn_implementation="eager").to(device)
    kept = torch.empty(KEPT_BYTES_PER_PARAMETER * gpt.num_parameters(), dtype=torch.uint8, device=device)
    try:
        return default_batch(cuda_step_fits(make_training_step(gpt, ctx), device))
    finally:
        del gpt, kept
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)  # the report's peak: the ladder and the race with transformers


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script itself")
    parser.add_argument("--batch", type=positive_int,
                        help=f"sequences of 1024 tokens per micro-batch (default: the largest power of two up to "
                             f"{MAX_DEFAULT_BATCH} at which the fp32 baseline fits this GPU)")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed optimizer steps per rung (default 10)")
    parser.add_argument("--accumulation", type=positive_int, default=4,
                        help="micro-batches per step on that rung (default 4)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; use --smoke to check the script on CPU")
    caps = detect_capabilities("cuda" if torch.cuda.is_available() else "cpu")
    if args.smoke:
        model, batch, ctx, steps, warmup, accumulation = "gpt-smoke", 2, 64, 2, 1, 2
    else:
        model, ctx, warmup = "gpt2-small", 1024, 3
        batch, steps, accumulation = args.batch, args.steps, args.accumulation
    batch_from = "smoke" if args.smoke else "--batch" if batch else "the largest power of two that fits"
    if batch is None:
        print(f"finding the largest batch at which {model}'s fp32 baseline fits {caps.name} ...", flush=True)
        try:
            batch = baseline_batch(model, ctx, caps.device)
        except BatchSizeError as err:
            raise SystemExit(f"{model} at context {ctx} on {caps.name}: {err}") from None
        print(f"batch {batch}", flush=True)
    env = environment_report(caps)
    path = results_path(args.out, "train_speed", caps.name)
    started = time.perf_counter()

    def with_run_info(report: dict) -> dict:
        return report | {"smoke": args.smoke, "cuda": torch.version.cuda, "flash_attn": env["flash_attn"],
                         "batch_from": batch_from, "seconds": round(time.perf_counter() - started, 1)}

    def save(partial: dict) -> None:  # after every rung: a run that stops early keeps what it measured
        save_json(path, with_run_info(partial))

    report = with_run_info(bench_train(model, batch, ctx, steps, warmup, accumulation, caps.device_type,
                                       progress=True, on_report=save))
    if caps.device_type == "cuda":
        report["max_memory_allocated"] = torch.cuda.max_memory_allocated()
    save_json(path, report)
    print(format_report(report))
    save_figure(plot_ladder(report), path.with_suffix(".png"))
    print(f"wrote {path} and .png in {report['seconds']} s")


if __name__ == "__main__":
    main()
