"""Attention benchmarks at real sizes on one GPU, in a few minutes; writes JSON and plots.

    python ch03_attention/gpu_benchmark.py                 # on a CUDA GPU: results/attention_<gpu>.json + PNGs
    python ch03_attention/gpu_benchmark.py --smoke --out /tmp/x   # the same code path, tiny, on CPU

Measures: every implementation at batch 8 x seq 1024, d_model 768, 12 heads, bf16 (fp16 on GPUs without
native bf16, such as the T4) (forward, forward + backward, compiled forward); time and peak memory against
sequence length up to 16k; the longest sequence each implementation fits (forward + backward, batch 1).
Notebooks 02 and 03 show the results. An item that fails (out of memory, a kernel this GPU lacks) is recorded
in the JSON's "errors" and the run goes on; the JSON is rewritten after every item.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from helpers.measure.attention_bench import bench_attention, make_step  # noqa: E402
from helpers.measure.results import ResultsFile, results_path, save_figure  # noqa: E402
from helpers.system.device import (  # noqa: E402
    DeviceCapabilities,
    autocast_dtype,
    detect_capabilities,
    dtype_name,
    parse_dtype,
)
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


def default_dtype(caps: DeviceCapabilities) -> str:
    """The dtype to benchmark in: the GPU's native half precision. bf16 from Ampere on; fp16 on a T4, where bf16
    is emulated and SDPA's fused kernels refuse it (so SDPA would fall back to its slow math kernel)."""
    return dtype_name(autocast_dtype(caps) or torch.float32)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script itself")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; use --smoke to check the script on CPU")
    caps = detect_capabilities("cuda" if torch.cuda.is_available() else "cpu")
    device = caps.device
    env = environment_report(caps)
    if args.smoke:
        batch, seq, d_model, heads, dtype, lens, limit, run_time = 2, 64, 64, 2, "float32", [32, 64], 128, 0.01
    else:
        batch, seq, d_model, heads, dtype = 8, 1024, 768, 12, default_dtype(caps)
        lens, limit, run_time = [1024, 2048, 4096, 8192, 16384], 262144, 0.5
    started = time.perf_counter()
    run = {"device_name": env["device_name"], "torch": env["torch"], "cuda": torch.version.cuda,
           "flash_attn": env["flash_attn"], "triton": env["triton"],
           "setting": dict(batch=batch, seq=seq, d_model=d_model, heads=heads, dtype=dtype), "modes": {},
           "seq_sweep": {"fwd": [], "fwdbwd": []}, "max_seq": {}}
    results = ResultsFile(results_path(args.out, "attention", env["device_name"]), run)
    for mode in ("fwd", "fwdbwd", "compiled"):
        names = ["sdpa"] if args.smoke and mode == "compiled" else None
        with results.item(f"modes {mode}"):
            rows = bench_attention(batch, seq, d_model, heads, dtype, device.type, mode, names, run_time,
                                   memory=not args.smoke)
            run["modes"][mode] = [asdict(r) for r in rows]
        print(f"{mode}: done at {time.perf_counter() - started:.0f} s", flush=True)
    for mode in ("fwd", "fwdbwd"):
        for length in lens:
            with results.item(f"seq_sweep {mode} seq {length}"):
                rows = bench_attention(1, length, d_model, heads, dtype, device.type, mode, SWEEP, run_time,
                                       memory=not args.smoke)
                run["seq_sweep"][mode] += [asdict(r) for r in rows]
    print(f"sweep: done at {time.perf_counter() - started:.0f} s", flush=True)
    torch_dtype = parse_dtype(dtype)
    ran = {r["name"] for r in run["modes"].get("fwdbwd", []) if r["status"] == "ok"}
    for name in (n for n in MAX_SEQ_CANDIDATES if n in ran):
        with results.item(f"max_seq {name}"):
            run["max_seq"][name] = longest_fitting_sequence(name, lens[0], limit, d_model, heads, torch_dtype, device)
    run["seconds"] = round(time.perf_counter() - started, 1)
    results.save()

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
    save_figure(fig, results.path.with_suffix(".png"))
    failed = f"; {len(run['errors'])} item(s) failed, see its errors" if run["errors"] else ""
    print(f"wrote {results.path} and .png in {run['seconds']} s{failed}")


if __name__ == "__main__":
    main()
