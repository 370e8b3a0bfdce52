"""Peak memory of a piece of work: CUDA's allocator statistics on GPU, peak RSS on CPU.

On CPU, memory freed earlier stays in the allocator's pools and RSS only ever rises in one process,
so a CPU measurement runs in a fresh Python process (`run_in_fresh_process`). There, glibc is told
to serve every block of 64 KiB or more with its own mmap and to return freed memory at once, so RSS
follows the live tensors; and on Linux the peak is reset right before the measured call
(`/proc/self/clear_refs`), so warm-up allocations do not count. On Linux the fresh process is forked
from a server that has imported torch and nothing else (no tensor, no thread pool), so each
measurement costs milliseconds instead of an interpreter start and torch's import (~2 s).
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import resource
import select
import signal
import subprocess
import sys
import tempfile
import time
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


_CALL = (
    "import importlib, json\n"
    "def call(function, kwargs):\n"
    "    module, name = function.split(':')\n"
    "    result = getattr(importlib.import_module(module), name)(**kwargs)\n"
    "    print('\\n' + json.dumps(result), flush=True)\n"
)

# The fork server: reads one request per line, forks a child that runs it with its output in files, and answers
# the child's pid and then its exit code. It imports torch once (what every fresh process would pay for) and never
# computes, so each child starts with an allocator that has held no tensor and no OpenMP pool to inherit. A forked
# child does not inherit the page-table entries of shared libraries' pages (the kernel faults them in on first
# use), so it first touches every file-backed page the server has resident (/proc/PID/pagemap's "present" bit):
# otherwise the code torch ran while importing would count in the first measured peak (~12 MB).
_SERVER = _CALL + (
    "import ctypes, os, struct, sys, traceback\n"
    "import torch\n"
    "def resident_like(pid, page=os.sysconf('SC_PAGE_SIZE')):\n"
    "    with open(f'/proc/{pid}/pagemap', 'rb') as pagemap, open('/proc/self/maps') as maps:\n"
    "        for line in maps:\n"
    "            fields = line.split()\n"
    "            if len(fields) < 6 or not fields[5].startswith('/') or 'r' not in fields[1]:\n"
    "                continue\n"
    "            start, end = (int(x, 16) for x in fields[0].split('-'))\n"
    "            pagemap.seek(start // page * 8)\n"
    "            for i, (entry,) in enumerate(struct.iter_unpack('<Q', pagemap.read((end - start) // page * 8))):\n"
    "                if entry >> 63:\n"
    "                    ctypes.string_at(start + i * page, 1)\n"
    "for line in sys.stdin:\n"
    "    request = json.loads(line)\n"
    "    pid = os.fork()\n"
    "    if pid == 0:\n"
    "        code = 1\n"
    "        try:\n"
    "            os.chdir(request['cwd'])\n"
    "            resident_like(os.getppid())\n"
    "            for fd, path in ((1, request['stdout']), (2, request['stderr'])):\n"
    "                os.dup2(os.open(path, os.O_WRONLY | os.O_TRUNC), fd)\n"
    "            call(request['function'], request['kwargs'])\n"
    "            code = 0\n"
    "        except BaseException:\n"
    "            traceback.print_exc()\n"
    "        finally:\n"
    "            sys.stdout.flush()\n"
    "            sys.stderr.flush()\n"
    "            os._exit(code)\n"
    "    print(json.dumps({'pid': pid}), flush=True)\n"
    "    print(json.dumps({'exit': os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])}), flush=True)\n"
)


class _ForkServer:
    """The server process and a line reader over its stdout that honours a deadline."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = env
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=env)
        self.pending = b""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self) -> None:
        if self.alive():
            self.proc.kill()
        self.proc.wait()

    def read(self, deadline: float) -> dict | None:
        """The server's next message, or None when the deadline passed first."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError("the fork server for fresh-process measurements exited; run the call again")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def call(self, function: str, kwargs: dict, timeout: float) -> subprocess.CompletedProcess:
        deadline = time.monotonic() + timeout
        with tempfile.TemporaryDirectory() as tmp:
            out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
            out.touch()
            err.touch()
            request = dict(function=function, kwargs=kwargs, cwd=os.getcwd(), stdout=str(out), stderr=str(err))
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            child = self.read(deadline)
            done = None if child is None else self.read(deadline)
            if done is None:
                if child is not None:
                    os.kill(child["pid"], signal.SIGKILL)
                raise subprocess.TimeoutExpired(function, timeout)
            return subprocess.CompletedProcess(function, done["exit"], out.read_text(), err.read_text())


_server: _ForkServer | None = None


def _stop_server() -> None:
    global _server
    if _server is not None:
        _server.stop()
        _server = None


atexit.register(_stop_server)


def can_fork_server() -> bool:
    """Linux with a readable /proc/self/pagemap: what the fork server needs to match a new interpreter's peaks."""
    try:
        with open("/proc/self/pagemap", "rb") as pagemap:
            return sys.platform == "linux" and len(pagemap.read(8)) == 8
    except OSError:
        return False


def run_in_fresh_process(function: str, timeout: float = 600, fork: bool | None = None, **kwargs) -> object:
    """Call `module:function(**kwargs)` in a new Python process and return its JSON result: a child forked from the
    fork server (started on the first call, again when the environment changed) where `can_fork_server()`, else a
    new interpreter. `fork=False` asks for the new interpreter."""
    global _server
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    if fork is None:
        fork = can_fork_server()
    if fork:
        if _server is None or not _server.alive() or _server.env != env:
            _stop_server()
            _server = _ForkServer(env)
        try:
            done = _server.call(function, kwargs, timeout)
        except BaseException:  # a timeout, an interrupt or a dead server: the next call starts a new one
            _stop_server()
            raise
    else:
        script = "import sys\n" + _CALL + "call(sys.argv[1], json.loads(sys.argv[2]))\n"
        done = subprocess.run([sys.executable, "-c", script, function, json.dumps(kwargs)], capture_output=True,
                              text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"{function} failed in a fresh process:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])
