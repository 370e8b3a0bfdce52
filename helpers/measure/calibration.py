"""One calibration per machine: the peak matmul FLOP/s of each dtype and the memory bandwidth at working sets
that fit L2, L3 and main memory, measured once and cached, so every notebook divides by the same peak and draws
the same roofs.

The cache is keyed by device name, torch version and thread count (a different key measures afresh);
`python -m helpers calibrate` prints it, `--refresh` measures again.
"""

from __future__ import annotations

import datetime
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F

from ..system.cli import Command, add_device, add_json
from ..system.device import detect_capabilities, dtype_name, parse_dtype
from ..system.files import atomic_path, cache_dir
from .timing import Spread, interleaved

LEVELS = ("L2", "L3", "DRAM")


def cache_sizes(device: torch.device, threads: int = 1) -> dict[str, int]:
    """Bytes of L2 and L3 cache that `threads` threads see together (Linux sysfs for a CPU, whose L2 is per core:
    each thread works on its own part of a tensor in its own L2; the L2 of a CUDA GPU)."""
    if device.type == "cuda":
        return {"L2": torch.cuda.get_device_properties(device).L2_cache_size}
    sizes = {}
    for index in sorted(Path("/sys/devices/system/cpu/cpu0/cache").glob("index*")):
        try:
            level, kind = int((index / "level").read_text()), (index / "type").read_text().strip()
            size = (index / "size").read_text().strip()
        except (OSError, ValueError):
            continue
        if level in (2, 3) and kind in ("Unified", "Data"):
            units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
            sizes[f"L{level}"] = int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size)
    if "L2" in sizes:
        sizes["L2"] *= threads
    return sizes


def working_sets(caches: dict[str, int], device: torch.device) -> dict[str, int]:
    """The bytes a bandwidth probe touches at each level: half a cache (so it stays resident), and for main
    memory a buffer far larger than the last cache."""
    sets = {level: caches[level] // 2 for level in ("L2", "L3") if caches.get(level)}
    floor = 1 << 30 if device.type == "cuda" else 256 << 20
    sets["DRAM"] = max(floor, 8 * max(caches.values(), default=0))
    return sets


def peak_shapes(n: int) -> list[tuple[int, int, int]]:
    """(m, k, n) of the matmuls the peak is the fastest of: a square one and a transformer feed-forward's two, for
    n tokens and width 3n/8 (n = 2048: GPT-2 small's 768 -> 3072 and back). Libraries block each shape
    differently, so no single shape is the fastest on every device."""
    d = 3 * n // 8
    return [(n, n, n), (n, d, 4 * d), (n, 4 * d, d)]


def measure_peak(device: torch.device, dtype: torch.dtype, n: int, rounds: int) -> Spread:
    """FLOP/s of the fastest of `peak_shapes(n)` (2·m·k·n FLOPs each) in `dtype`, each both as `a @ b` and as a
    Linear layer computes it (`F.linear(a, w)`, w stored transposed: another kernel, faster on some CPUs), all
    taking turns: the practical peak of this device."""
    steps, flops = {}, {}
    for m, k, n_out in peak_shapes(n):
        a = torch.randn(m, k, device=device).to(dtype)
        b = torch.randn(k, n_out, device=device).to(dtype)
        w = b.t().contiguous()
        steps[(m, k, n_out, "a @ b")] = lambda a=a, b=b: a @ b
        steps[(m, k, n_out, "linear")] = lambda a=a, w=w: F.linear(a, w)
        flops[(m, k, n_out, "a @ b")] = flops[(m, k, n_out, "linear")] = 2 * m * k * n_out
    seconds = interleaved(steps, device, rounds=rounds)
    return max((s.map(lambda t, f=flops[name]: f / t) for name, s in seconds.items()), key=lambda r: r.median)


def measure_bandwidth(device: torch.device, working_set: int, rounds: int) -> Spread:
    """Bytes/s of copying a buffer into another, the two together `working_set` bytes (each copy reads the source
    once and writes the destination once)."""
    src = torch.ones(max(working_set // 8, 1), device=device)
    dst = torch.empty_like(src)
    seconds = interleaved({"copy": lambda: dst.copy_(src)}, device, rounds=rounds)["copy"]
    return seconds.map(lambda s: 2 * src.numel() * 4 / s)


@dataclass
class Calibration:
    """A device's measured peaks (FLOP/s per dtype) and bandwidths (bytes/s per cache level), with their spread."""

    device_type: str
    device_name: str
    torch_version: str
    threads: int
    caches: dict[str, int]  # bytes of L2, L3 where known
    working_sets: dict[str, int]  # bytes each bandwidth probe touched
    peaks: dict[str, Spread] = field(default_factory=dict)
    bandwidths: dict[str, Spread] = field(default_factory=dict)
    measured: str = ""  # UTC date

    @property
    def key(self) -> str:
        return calibration_key(self.device_type, self.device_name, self.torch_version, self.threads)

    def peak(self, dtype: torch.dtype | None) -> float:
        """Median peak FLOP/s of `dtype` (None: float32)."""
        return self.peaks[dtype_name(dtype)].median

    def level_for(self, working_set: int) -> str:
        """The level whose bandwidth bounds an operation on `working_set` bytes: of the levels that can hold it,
        the fastest measured (a small copy's fixed cost can make the L2 probe slower than the L3 one)."""
        holding = [level for level in LEVELS if level in self.bandwidths
                   and (level == "DRAM" or working_set <= self.caches.get(level, 0))]
        return max(holding, key=lambda level: self.bandwidths[level].median)

    def bandwidth(self, working_set: int | None = None) -> float:
        """Median bytes/s at the level that bounds `working_set` (None: main memory)."""
        return self.bandwidths[self.level_for(working_set) if working_set is not None else "DRAM"].median

    def to_json(self) -> dict:
        return {"device_type": self.device_type, "device_name": self.device_name,
                "torch_version": self.torch_version, "threads": self.threads, "caches": self.caches,
                "working_sets": self.working_sets, "measured": self.measured,
                "peaks": {k: list(v.samples) for k, v in self.peaks.items()},
                "bandwidths": {k: list(v.samples) for k, v in self.bandwidths.items()}}

    @classmethod
    def from_json(cls, data: dict) -> Calibration:
        spreads = {k: {name: Spread(tuple(s)) for name, s in data[k].items()} for k in ("peaks", "bandwidths")}
        return cls(**{**data, **spreads})

    def report(self) -> str:
        lines = [f"{self.device_name} ({self.device_type}), torch {self.torch_version}, {self.threads} threads, "
                 f"measured {self.measured}; median (IQR) of each figure's runs"]
        for name, spread in self.peaks.items():
            lines.append(f"  peak matmul {name:<9} {spread.map(lambda f: f / 1e12):.3g} TFLOP/s")
        for level, spread in self.bandwidths.items():
            lines.append(f"  bandwidth {level:<4} ({self.working_sets[level] / 2**20:8.2f} MiB copied) "
                         f"{spread.map(lambda b: b / 1e9):.3g} GB/s")
        return "\n".join(lines)


def calibration_key(device_type: str, device_name: str, torch_version: str, threads: int) -> str:
    text = json.dumps([device_type, device_name, torch_version, threads])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def calibrate(device: torch.device | str | None = None, dtypes: tuple[str, ...] = ("float32",),
              rounds: int = 7, matmul_n: int | None = None, dram_bytes: int | None = None) -> Calibration:
    """Measure a calibration of `device` (default: the course's device) for `dtypes`; `matmul_n` and `dram_bytes`
    override the peak's matmul size and main memory's working set (a quick check uses small ones)."""
    caps = detect_capabilities(None if device is None else torch.device(device).type)
    device = caps.device
    caches = cache_sizes(device, torch.get_num_threads())
    sets = working_sets(caches, device)
    if dram_bytes is not None:
        sets["DRAM"] = dram_bytes
    calibration = Calibration(device.type, caps.name, torch.__version__, torch.get_num_threads(), caches, sets,
                              measured=datetime.datetime.now(datetime.UTC).date().isoformat())
    _measure_peaks(calibration, dtypes, rounds, matmul_n)
    for level, size in sets.items():
        calibration.bandwidths[level] = measure_bandwidth(device, size, rounds)
    return calibration


def _measure_peaks(calibration: Calibration, dtypes, rounds: int, matmul_n: int | None) -> None:
    device = torch.device(calibration.device_type)
    n = matmul_n or (8192 if device.type == "cuda" else 2048)
    for name in dtypes:
        calibration.peaks[name] = measure_peak(device, parse_dtype(name), n, rounds)


def load_calibration(device: torch.device | str | None = None, dtypes: tuple[str, ...] = ("float32",),
                     refresh: bool = False) -> Calibration:
    """This machine's calibration from the cache, measuring (and caching) whatever it lacks: all of it when the
    device, torch version or thread count differ, or only a missing dtype's peak."""
    caps = detect_capabilities(None if device is None else torch.device(device).type)
    key = calibration_key(caps.device.type, caps.name, torch.__version__, torch.get_num_threads())
    path = cache_dir() / f"calibration-{key}.json"
    calibration = None
    if path.is_file() and not refresh:
        try:
            calibration = Calibration.from_json(json.loads(path.read_text()))
        except (ValueError, TypeError, KeyError):  # a damaged or older file: measure again
            calibration = None
    missing = tuple(d for d in dtypes if calibration is None or d not in calibration.peaks)
    if calibration is None:
        calibration = calibrate(caps.device, dtypes)
    elif missing:
        _measure_peaks(calibration, missing, 7, None)
    else:
        return calibration
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(calibration.to_json(), indent=1) + "\n")
    return calibration


def _arguments(parser) -> None:
    add_device(parser, "the course's device")
    parser.add_argument("--dtype", nargs="+", choices=["float32", "bfloat16", "float16"],
                        help="dtypes whose peak to measure (default: float32 and the autocast dtype)")
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    add_json(parser, shape="one JSON object (with every run)")


def _run(args) -> int:
    from ..system.device import autocast_dtype, default_device_type

    device = args.device or default_device_type()
    dtypes = tuple(args.dtype or dict.fromkeys(["float32", dtype_name(autocast_dtype(detect_capabilities(device)))]))
    calibration = load_calibration(device, dtypes, refresh=args.refresh)
    if args.json:
        print(json.dumps({"key": calibration.key, **calibration.to_json()}, indent=2))
    else:
        print(calibration.report())
        print(f"cached in {cache_dir()}/calibration-{calibration.key}.json")
    return 0


COMMAND = Command("calibrate", "peak matmul FLOP/s and memory bandwidths of this machine (measured once, then cached)",
                  _arguments, _run)
