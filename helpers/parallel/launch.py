"""Launching multi-process runs: torchrun as a subprocess, with a timeout and the stacks of a hung run.

`launch` runs a script under `torchrun` (`python -m torch.distributed.run --standalone`), `run_for_result` also
reads back the JSON result the script writes (`--out`); a rank that fails or a run that hangs (a rank waiting in a
collective its peers never join) ends in a `DistributedRunError` that carries the output, and every process of the
run is killed.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from ..system.repository import REPOSITORY_URL, ROOT

# glibc serves every block of 64 KiB or more with its own mmap and returns freed memory at once, so a worker's
# resident set follows its live tensors (as helpers.measure.memory's fresh-process measurements do):
# pass as launch(env=...).
MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}


class DistributedRunError(RuntimeError):
    """A torchrun run failed or did not finish in time; the message carries the end of its output."""


def torchrun_command(script: str | Path, args: Sequence[object], nproc: int) -> list[str]:
    """`python -m torch.distributed.run` with this interpreter, so the workers use the same environment as the
    caller; `--standalone` picks a free port, so several runs can share a machine."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            str(script), *map(str, args)]


def _descendants(pid: int) -> list[int] | None:
    """Every process below `pid`, from /proc (Linux); None where there is no /proc."""
    proc_dir = Path("/proc")
    if not (proc_dir / "self" / "stat").exists():
        return None
    children: dict[int, list[int]] = {}
    for stat in proc_dir.glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])  # the field after the state letter
        except (OSError, IndexError, ValueError):
            continue  # the process ended while we looked
        children.setdefault(ppid, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def _catches(pid: int, signum: int) -> bool:
    """Whether process `pid` has a handler for `signum` (Linux's /proc/PID/status SigCgt mask): a worker that has
    not yet reached `setup` would be killed by SIGUSR1 instead of printing its stack."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("SigCgt:"):
                return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    except (OSError, ValueError):
        pass
    return False


STACK_HEADER = re.compile(r"(?:Current thread|Thread) 0x")  # faulthandler's first line for each thread


def _rank_of(pid: int) -> int | None:
    """The worker's rank, from its environment (torchrun sets RANK); None where that cannot be read."""
    try:
        for item in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
            if item.startswith(b"RANK="):
                return int(item[5:])
    except (OSError, ValueError):
        pass
    return None


def _read_so_far(proc: subprocess.Popen) -> str | None:
    """Everything the run has printed so far (newlines as text mode reads them), or None if it has ended; the pipe
    keeps what was read for the next `communicate`."""
    try:
        proc.communicate(timeout=0.25)
        return None
    except subprocess.TimeoutExpired as partial:
        return (partial.output or b"").decode(errors="replace").replace("\r\n", "\n").replace("\r", "\n")


def _dump_stacks(proc: subprocess.Popen, wait_s: float = 15.0) -> tuple[dict[str, str], int, tuple[int, int]]:
    """Ask every worker that can (faulthandler on SIGUSR1, registered by `setup`) to print its stack, one worker at a
    time: they share torchrun's pipe, and two dumps written at once interleave character by character. Each is
    waited for until it stops growing, `wait_s` in all (a loaded machine may take a while to schedule a worker); a
    worker not asked in time is not asked at all. Returns each asked worker's stack by rank ("" where none arrived
    in time), the number of workers, and where the stacks lie in the run's output (start, end)."""
    workers = _descendants(proc.pid) or []
    output = _read_so_far(proc)
    if not hasattr(signal, "SIGUSR1") or output is None:
        return {}, len(workers), (0, 0)
    stacks, first, deadline = {}, len(output), time.monotonic() + wait_s
    ranks = {pid: _rank_of(pid) for pid in workers if _catches(pid, signal.SIGUSR1)}
    for pid in sorted(ranks, key=lambda pid: (ranks[pid] is None, ranks[pid] or 0, pid)):
        rank = f"rank {ranks[pid]}" if ranks[pid] is not None and f"rank {ranks[pid]}" not in stacks else f"pid {pid}"
        start, quiet = len(output), 0
        if time.monotonic() < deadline:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                continue
        while time.monotonic() < deadline and quiet < 2:  # two polls without growth after its first line: complete
            grown = _read_so_far(proc)
            if grown is None:
                return stacks, len(workers), (first, len(output))  # the run ended by itself
            quiet = quiet + 1 if grown == output and STACK_HEADER.search(output, start) else 0
            output = grown
        stacks[rank] = output[start:]
    return stacks, len(workers), (first, len(output))


def _stop(proc: subprocess.Popen) -> None:
    """Kill torchrun and every worker. torchrun starts each worker in a session of its own, so killing
    torchrun's process group would orphan them: find them first, then kill them all."""
    workers = _descendants(proc.pid)
    if workers is None:  # no /proc: torchrun stops its workers on SIGTERM (it waits up to 30 s for them)
        proc.terminate()
        try:
            proc.wait(timeout=40)
        except subprocess.TimeoutExpired:
            pass
        workers = []
    for pid in workers:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=10)  # torchrun reaps its dead workers and exits on its own
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def first_traceback(output: str, max_lines: int = 40) -> str:
    """The end of the first worker traceback in torchrun's output (torchrun's own summary follows it and only
    says which rank failed). Where PyTorch prefixed the lines with "[rankN]:", the first rank's traceback and every
    other rank's last line (a rank may fail only because its peer did)."""
    lines = output.splitlines()
    ranks = list(dict.fromkeys(m.group(0) for line in lines if (m := re.match(r"\[rank\d+\]:", line))))
    if ranks:
        by_rank = {r: [line for line in lines if line.startswith(r)] for r in ranks}
        return "\n".join(by_rank[ranks[0]][-max_lines:] + [by_rank[r][-1] for r in ranks[1:]])
    start = next((i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call last)")), None)
    if start is None:
        return "\n".join(lines[-max_lines:])
    end = next((i for i in range(start + 1, len(lines)) if lines[i] and not lines[i].startswith(" ")), len(lines) - 1)
    return "\n".join(lines[start : end + 1][-max_lines:])


def hang_report(stacks: dict[str, str], other_output: str, max_chars: int = 3000) -> str:
    """Each rank's stack (faulthandler's dump on SIGUSR1, the waiting frame first; at most `max_chars` each), then the
    end of the run's other output."""
    if not stacks:
        return other_output[-max_chars:]
    shown = "\n".join(f"{rank}:\n{text.strip()[:max_chars] or '(no stack arrived in time)'}"
                      for rank, text in stacks.items())
    return f"{shown}\nthe run's last output:\n{other_output[-max_chars:]}"


def launch(script: str | Path, args: Sequence[object] = (), nproc: int = 2, timeout: float = 300, threads: int = 1,
           env: dict[str, str] | None = None) -> str:
    """Run `script` on `nproc` processes under torchrun and return its output (stdout and stderr interleaved).

    Each worker gets `threads` intra-op threads (OMP_NUM_THREADS), so `nproc` workers do not oversubscribe the
    cores. Raises DistributedRunError on a non-zero exit or when `timeout` seconds pass.
    """
    script = Path(script)
    if not script.is_file():
        raise DistributedRunError(f"no script at {script}; pass the path of a script that calls "
                                  "helpers.parallel.runtime.setup")
    if nproc < 1:
        raise ValueError(f"nproc must be 1 or more, got {nproc}")
    child_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(torchrun_command(script, list(args), nproc), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=child_env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stacks, workers, (first, last) = _dump_stacks(proc)
        asked = len(stacks)
        _stop(proc)
        try:
            output, _ = proc.communicate(timeout=10)  # what the run printed before it was stopped
        except subprocess.TimeoutExpired:
            output = "(no output: a process that outlived the run still holds the pipe)"
        starting = (" No worker process had started yet (torchrun itself was still starting: imports take long on "
                    "a busy machine)." if workers == 0 else
                    f" {workers - asked} of {workers} worker processes had not reached setup() yet (still starting: "
                    "imports take long on a busy machine)." if asked < workers else "")
        raise DistributedRunError(
            f"{script.name} on {nproc} processes did not finish within {timeout:.0f} s and was killed.{starting} A "
            "distributed run hangs when one rank waits in a collective (all_reduce, send/recv, a pipeline schedule) "
            "that another rank never enters; check that every rank makes the same calls in the same order, or raise "
            f"the timeout for a bigger run. Where each rank was (its stack), then the last output:\n"
            f"{hang_report(stacks, output[:first] + output[last:])}"
        ) from None
    except BaseException:  # e.g. KeyboardInterrupt in a notebook: do not leave workers behind
        _stop(proc)
        raise
    if proc.returncode != 0:
        raise DistributedRunError(
            f"{script.name} on {nproc} processes failed (exit code {proc.returncode}); the failing rank's "
            f"traceback:\n{first_traceback(output)}"
        )
    return output


def run_for_result(script: str | Path, args: Sequence[object] = (), nproc: int = 2, timeout: float = 300,
                   env: dict[str, str] | None = None, show: bool = False) -> dict:
    """Run `script` under torchrun with `--out FILE` added and return the JSON result it writes there (the file lives
    in a temporary folder, removed once read). `show`: first print the command as one types it in the script's
    folder, RESULT.json standing for the file (whose local path is never printed)."""
    if show:
        print("python", *torchrun_command(Path(script).name, args, nproc)[1:], "--out RESULT.json")
    with tempfile.TemporaryDirectory(prefix="torchrun_") as folder:
        out = Path(folder) / "result.json"
        launch(script, ["--out", out, *args], nproc=nproc, timeout=timeout, env=env)
        return json.loads(out.read_text())


def chapter_script(name: str, chapter: str = "ch07_parallel") -> Path:
    """A chapter's script: next to the notebook (a notebook runs in its own folder), or in the clone `helpers`
    was installed from. A notebook opened alone (e.g. on Colab) needs the repository for its scripts."""
    here = Path.cwd()
    for candidate in (here / name, here / chapter / name, ROOT / chapter / name):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"{chapter}/{name} was not found: the chapter's scripts come with the repository. "
                            f"Clone it (git clone {REPOSITORY_URL}) and run the notebook from its {chapter}/ folder")
