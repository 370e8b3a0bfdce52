"""Throughput and MFU of GPT-2 small ... XL on one GPU, at the largest batch that fits; writes JSON and a plot.

    python ch04_flops/gpu_benchmark.py                       # on a CUDA GPU: results/flops_<gpu>.json + .png
    python ch04_flops/gpu_benchmark.py --smoke --out /tmp/x  # the same code path, tiny, on CPU

For each preset (context 1024, dropout off, bf16 autocast; fp16 with a gradient scaler on GPUs without bf16):
the largest batch whose training step fits (doubling, then bisection, catching out-of-memory errors), tokens/s
of a training step at every power of two up to it and of a forward pass at it, and MFU against the datasheet's
dense peak and against a measured matmul. Also the device's measured matmul peak and memory bandwidth and
gpt2-small's operations timed for the roofline. Notebook 02 shows the results. A preset or an operation that
fails is recorded in the JSON's "errors" and the run goes on; the JSON is rewritten after each of them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import time
from dataclasses import asdict
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import torch  # noqa: E402

from helpers.measure.batch_size import BatchSizeError, cuda_step_fits, largest_batch_size, make_training_step  # noqa: E402
from helpers.measure.calibration import calibrate  # noqa: E402
from helpers.measure.mfu import measure_throughput, mfu, peak_flops  # noqa: E402
from helpers.measure.results import ResultsFile, results_path, save_figure  # noqa: E402
from helpers.measure.roofline import gpt_operations, place, time_operation  # noqa: E402
from helpers.model.config import PRESETS  # noqa: E402
from helpers.model.gpt import GPT  # noqa: E402
from helpers.system.args import positive_float, positive_int  # noqa: E402
from helpers.system.device import autocast_dtype, detect_capabilities, dtype_name  # noqa: E402
from helpers.system.env import environment_report  # noqa: E402

GPT2 = ["gpt2-small", "gpt2-medium", "gpt2-large", "gpt2-xl"]


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def throughput_or_oom(model: GPT, mode: str, batch: int, seq: int, dtype, min_run_time: float, peak: float,
                      measured_peak: float, device: torch.device) -> dict | None:
    """One throughput measurement with its MFU; None when it ran out of memory (it is at the edge)."""
    try:
        t = measure_throughput(model, mode, batch, seq, dtype, min_run_time)
    except torch.OutOfMemoryError:
        t = None
    model.zero_grad(set_to_none=True)
    release(device)
    if t is None:
        return None
    return {**asdict(t), "mfu": mfu(t.flops_per_s, peak), "mfu_vs_measured_peak": mfu(t.flops_per_s, measured_peak)}


def bench_preset(name: str, seq: int, max_batch: int, dtype, min_run_time: float, peak: float,
                 measured_peak: float, device: torch.device) -> dict:
    """The largest batch that fits, then throughput and MFU; a preset that does not fit at all says so."""
    config = dataclasses.replace(PRESETS[name], dropout=0.0)
    torch.manual_seed(0)
    try:
        model = GPT(config).to(device)
        step = make_training_step(model, seq, dtype)
        search = largest_batch_size(cuda_step_fits(step, device), limit=max_batch)
    except (BatchSizeError, torch.OutOfMemoryError) as err:
        status = f"does not fit: {err}".splitlines()[0]
    else:
        status = "ok"
    if status != "ok":
        model = step = None
        release(device)
        return {"preset": name, "seq": seq, "status": status}
    del step  # and with it the search's optimizer state: each measurement below makes its own
    release(device)
    sizes = sorted({*(2**i for i in range(search.batch_size.bit_length()) if 2**i < search.batch_size),
                    search.batch_size})
    sweep = {b: throughput_or_oom(model, "train", b, seq, dtype, min_run_time, peak, measured_peak, device)
             for b in sizes}
    measured = [b for b, row in sweep.items() if row is not None]
    if not measured:
        del model
        release(device)
        return {"preset": name, "seq": seq, "status": f"batch {search.batch_size} fit in the search, but every "
                "throughput measurement ran out of memory", "batch_search": asdict(search)}
    best = max(measured)
    row = {"preset": name, "status": status, "parameters": model.num_parameters(), "seq": seq, "batch_size": best,
           "batch_search": asdict(search), "train": sweep[best],
           "forward": throughput_or_oom(model, "forward", best, seq, dtype, min_run_time, peak, measured_peak, device),
           "train_by_batch": [{"batch": b, **(r or {"status": "out of memory"})} for b, r in sweep.items()]}
    if device.type == "cuda":
        row["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    del model
    release(device)
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, any device: checks the script itself")
    parser.add_argument("--models", nargs="+", choices=list(PRESETS), help=f"presets (default: {' '.join(GPT2)})")
    parser.add_argument("--max-batch", type=positive_int, help="largest batch size tried (default 64; smoke 4)")
    parser.add_argument("--min-run-time", type=positive_float, help="seconds of timed runs per measurement (default 1)")
    args = parser.parse_args(argv)
    if not args.smoke and not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU; use --smoke to check the script on CPU")
    caps = detect_capabilities("cuda" if torch.cuda.is_available() else "cpu")
    device = caps.device
    if args.smoke:
        presets, seq, max_batch, dtype, run_time = args.models or ["gpt-smoke"], 64, args.max_batch or 4, None, 0.01
        matmul_n, copy_bytes, roofline_shape = 256, 8 << 20, ("gpt-smoke", 2, 64)
    else:
        presets, seq, max_batch, run_time = args.models or GPT2, 1024, args.max_batch or 64, args.min_run_time or 1.0
        dtype, matmul_n, copy_bytes, roofline_shape = autocast_dtype(caps), None, None, ("gpt2-small", 8, 1024)
    env = environment_report(caps)
    started = time.perf_counter()
    calibration = calibrate(device, (dtype_name(dtype),), matmul_n=matmul_n, dram_bytes=copy_bytes)
    measured_peak, bandwidth = calibration.peak(dtype), calibration.bandwidth()
    peak = peak_flops(caps.name, device.type, dtype, measure=lambda: measured_peak)
    run = {"device_name": caps.name, "torch": env["torch"], "cuda": torch.version.cuda, "smoke": args.smoke,
           "dtype": dtype_name(dtype), "peak_flops": peak.flops,
           "peak_source": peak.source, "measured_matmul_flops": measured_peak, "measured_bandwidth": bandwidth,
           "calibration": calibration.to_json(), "presets": []}
    results = ResultsFile(results_path(args.out, "flops", caps.name), run)
    for name in presets:
        if device.type == "cuda":  # each preset's peak its own, a failed one's included
            torch.cuda.reset_peak_memory_stats(device)
        with results.item(f"preset {name}"):
            run["presets"].append(bench_preset(name, seq, max_batch, dtype, run_time, peak.flops, measured_peak,
                                              device))
        error = run["errors"].get(f"preset {name}")
        if error:  # a row all the same: readers list every preset, with why it has no numbers
            run["presets"].append({"preset": name, "seq": seq, "status": error.splitlines()[0]})
            results.save()
        print(f"{name}: done at {time.perf_counter() - started:.0f} s", flush=True)
    config_name, batch, roofline_seq = roofline_shape
    run["roofline"] = {"preset": config_name, "batch": batch, "seq": roofline_seq, "operations": []}
    operations = []
    with results.item("roofline operations"):
        operations = gpt_operations(PRESETS[config_name], batch, roofline_seq, device, dtype or torch.float32)
    for op in operations:
        with results.item(f"roofline {op.name}"):
            seconds = time_operation(op)
            placed = place(op, seconds, calibration, dtype)
            run["roofline"]["operations"].append({"name": op.name, "kind": op.kind, "flops": op.flops,
                                                  "bytes": op.bytes, "intensity": op.intensity,
                                                  "seconds": seconds.summary(), "flops_per_s": placed.achieved.median,
                                                  "memory_level": placed.level, "of_roof": placed.of_roof})
        release(device)
    del operations
    run["seconds"] = round(time.perf_counter() - started, 1)
    results.save()
    plot(run, results.path.with_suffix(".png"))
    failed = f"; {len(run['errors'])} item(s) failed, see its errors" if run["errors"] else ""
    print(f"wrote {results.path} and .png in {run['seconds']} s{failed}")


def plot(run: dict, path: Path) -> None:
    """Tokens/s against batch size, MFU per preset, and the roofline with gpt2-small's operations."""
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(17, 4.8))
    rows = [row for row in run["presets"] if row["status"] == "ok"]
    for row in rows:
        points = [(r["batch"], r["tokens_per_s"]) for r in row["train_by_batch"] if "tokens_per_s" in r]
        ax1.plot(*zip(*points, strict=True), "o-", label=row["preset"])
    ax1.set_xscale("log", base=2)
    ax1.set_xlabel("batch size (sequences of 1024 tokens)" if not run["smoke"] else "batch size")
    ax1.set_ylabel("training tokens/s")
    ax1.set_title("training throughput")
    ax1.legend(fontsize=8)
    ax2.bar([row["preset"] for row in rows], [100 * row["train"]["mfu"] for row in rows], label="training step")
    ax2.plot([row["preset"] for row in rows if row["forward"]], [100 * row["forward"]["mfu"] for row in rows
                                                                 if row["forward"]], "ko", label="forward")
    ax2.set_ylabel(f"MFU (%) vs {run['peak_flops'] / 1e12:.3g} TFLOP/s")
    ax2.set_title(f"MFU at the largest batch ({run['peak_source']})", fontsize=9)
    ax2.legend(fontsize=8)
    ops = run["roofline"]["operations"]
    peak, bandwidth = run["measured_matmul_flops"], run["measured_bandwidth"]
    ridge = peak / bandwidth
    intensities = [op["intensity"] for op in ops] or [ridge / 50, ridge * 5]  # no operation measured: the roof
    low, high = min(intensities) / 2, max(intensities) * 2
    ax3.loglog([low, ridge, max(high, 2 * ridge)], [low * bandwidth, peak, peak], "k-", label="roofline")
    for op in ops:
        ax3.loglog(op["intensity"], op["flops_per_s"], "o", label=op["name"])
    ax3.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax3.set_ylabel("FLOP/s")
    ax3.set_title(f"roofline: {run['roofline']['preset']}, batch {run['roofline']['batch']}, {run['dtype']}")
    ax3.legend(fontsize=6)
    fig.suptitle(f"{run['device_name']}, {run['dtype']}")
    fig.tight_layout()
    save_figure(fig, path)


if __name__ == "__main__":
    main()
