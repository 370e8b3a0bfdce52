"""Peak memory of a piece of work: CUDA's allocator statistics on GPU, peak RSS on CPU.

On CPU, memory freed earlier stays in the allocator's pools and RSS only ever rises in one process,
so a CPU measurement runs in a fresh Python process (`run_in_fresh_process`). There, glibc is told
to serve every block of 64 KiB or more with its own mmap and to return freed memory at once, so RSS
follows the live tensors; and on Linux the peak is reset right before the measured call
(`/proc/self/clear_refs`), so warm-up allocations do not count.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch


def proc_status_bytes(field: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024  # reported in kB
    except OSError:
        pass
    return None


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (Linux): memory a new allocation can get without swapping."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _ru_maxrss_bytes() -> int:
    scale = 1 if sys.platform == "darwin" else 1024  # bytes on macOS, kB on Linux
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


def _reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark to the current RSS (Linux only)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_above_baseline(fn: Callable[[], object]) -> int:
    """Bytes of resident memory `fn()` adds at its peak above what the process held just before.

    Call it in a fresh process (see `run_in_fresh_process`): in a process that already freed big
    buffers, the allocator may reuse them and the number is too low.
    """
    gc.collect()
    if _reset_peak_rss():
        before = proc_status_bytes("VmRSS")
        fn()
        return max(0, proc_status_bytes("VmHWM") - before)
    before = _ru_maxrss_bytes()  # no reset available: peak above the process's earlier peak
    fn()
    return max(0, _ru_maxrss_bytes() - before)


def peak_cuda_bytes(fn: Callable[[], object], device: torch.device) -> int:
    """Bytes the CUDA caching allocator holds at `fn()`'s peak above what was allocated before."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def run_in_fresh_process(function: str, timeout: float = 600, **kwargs) -> object:
    """Call `module:function(**kwargs)` in a new Python process and return its JSON result."""
    module, name = function.split(":")
    script = (
        "import json, sys\n"
        f"from {module} import {name} as f\n"
        "print('\\n' + json.dumps(f(**json.loads(sys.argv[1]))))\n"
    )
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    done = subprocess.run([sys.executable, "-c", script, json.dumps(kwargs)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{function} failed in a fresh process:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
