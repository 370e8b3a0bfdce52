"""Attention benchmarks at real sizes on one GPU, in a few minutes; writes JSON and plots.

    python ch03_attention/gpu_benchmark.py                 # on a CUDA GPU: results/attention_<gpu>.json + PNGs
    python ch03_attention/gpu_benchmark.py --smoke --out /tmp/x   # the same code path, tiny, on CPU

Measures: every implementation at batch 8 x seq 1024, d_model 768, 12 heads, bf16 (forward, forward +
backward, compiled forward); time and peak memory against sequence length up to 16k; the longest
sequence each implementation fits (forward + backward, batch 1). Notebooks 02 and 03 show the results.
"""

from __future__ import annotations

import argparse
import json
import re
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from helpers.measure.attention_bench import bench_attention, make_step  # noqa: E402
from helpers.system.device import parse_dtype
from helpers.system.env import environment_report  # noqa: E402

SWEEP = ["eager", "sdpa", "sdpa_mask", "flash_attention_2", "flash_triton", "flash_torch"]
MAX_SEQ_CANDIDATES = ["eager", "sdpa", "sdpa_mask", "flash_attention_2", "flash_triton"]


def _fits(name: str, seq: int, d_model: int, heads: int, dtype: torch.dtype, device: torch.device) -> bool:
    try:
        _, step = make_step(name, 1, seq, d_model, heads, dtype, device, "fwdbwd")
        step()
        return True
    except torch.OutOfMemoryError:
        return False


def longest_fitting_sequence(name: str, start: int, limit: int, d_model: int, heads: int, dtype: torch.dtype,
                             device: torch.device) -> int | None:
    """Double the sequence length until forward + backward (batch 1) runs out of memory."""
    best, seq = None, start
    while seq <= limit and _fits(name, seq, d_model, heads, dtype, device):
        best, seq = seq, seq * 2
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script itself")
    args = parser.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; use --smoke to check the script on CPU")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    env = environment_report()
    if args.smoke:
        batch, seq, d_model, heads, dtype, lens, limit, run_time = 2, 64, 64, 2, "float32", [32, 64], 128, 0.01
    else:
        batch, seq, d_model, heads, dtype = 8, 1024, 768, 12, "bfloat16"
        lens, limit, run_time = [1024, 2048, 4096, 8192, 16384], 262144, 0.5
    started = time.perf_counter()
    run = {"device_name": env["device_name"], "torch": env["torch"], "cuda": torch.version.cuda,
           "flash_attn": env["flash_attn"], "triton": env["triton"],
           "setting": dict(batch=batch, seq=seq, d_model=d_model, heads=heads, dtype=dtype), "modes": {}}
    for mode in ("fwd", "fwdbwd", "compiled"):
        names = ["sdpa"] if args.smoke and mode == "compiled" else None
        rows = bench_attention(batch, seq, d_model, heads, dtype, device.type, mode, names, run_time,
                               memory=not args.smoke)
        run["modes"][mode] = [asdict(r) for r in rows]
        print(f"{mode}: done at {time.perf_counter() - started:.0f} s", flush=True)
    run["seq_sweep"] = {}
    for mode in ("fwd", "fwdbwd"):
        run["seq_sweep"][mode] = [asdict(r) for s in lens for r in
                                  bench_attention(1, s, d_model, heads, dtype, device.type, mode, SWEEP, run_time,
                                                  memory=not args.smoke)]
    print(f"sweep: done at {time.perf_counter() - started:.0f} s", flush=True)
    torch_dtype = parse_dtype(dtype)
    run["max_seq"] = {name: longest_fitting_sequence(name, lens[0], limit, d_model, heads, torch_dtype, device)
                      for name in MAX_SEQ_CANDIDATES
                      if next(r for r in run["modes"]["fwdbwd"] if r["name"] == name)["status"] == "ok"}
    run["seconds"] = round(time.perf_counter() - started, 1)

    args.out.mkdir(parents=True, exist_ok=True)
    slug = re.sub(r"[^a-z0-9]+", "-", env["device_name"].lower()).strip("-")
    (args.out / f"attention_{slug}.json").write_text(json.dumps(run, indent=1))
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, (mode, rows) in zip(axes, run["seq_sweep"].items(), strict=True):
        for name in SWEEP:
            points = [(r["seq"], r["median_ms"]) for r in rows if r["name"] == name and r["status"] == "ok"]
            if points:
                ax.loglog(*zip(*points, strict=True), "o-", label=name)
        ax.set_title(f"{mode}, batch 1, d_model {d_model}, {heads} heads, {dtype}")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("median ms")
        ax.legend(fontsize=8)
    fig.suptitle(env["device_name"])
    fig.tight_layout()
    fig.savefig(args.out / f"attention_{slug}.png", dpi=120)
    print(f"wrote {args.out}/attention_{slug}.json and .png in {run['seconds']} s")


if __name__ == "__main__":
    main()
