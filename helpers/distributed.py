"""Multi-process training with the real engine: torchrun launched as a subprocess, process groups, and what the
processes send to each other.

* `launch` runs a script under `torchrun` (`python -m torch.distributed.run --standalone`) with a timeout; a rank
  that fails or a run that hangs (a rank waiting in a collective its peers never join) ends in a
  `DistributedRunError` that carries the output, and every process of the run is killed.
* `setup` (inside the script) starts the process group: NCCL with one GPU per rank, gloo on CPU.
* Communication accounting: the ring all-reduce's analytic volume, a DDP communication hook that counts the bytes
  DDP hands to `all_reduce`, a ring all-reduce written with send/recv that counts what it sends, and the bytes the
  process really wrote to its sockets (`/proc/self/io`, gloo on Linux).
* The scripts' shared command line (model size, device, output JSON) and small result helpers.
"""

# No `from __future__ import annotations`: DDP checks the communication hooks' annotations at runtime.
import argparse
import dataclasses
import faulthandler
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from .config import GPTConfig

# ---- launching ----


# glibc serves every block of 64 KiB or more with its own mmap and returns freed memory at once, so a worker's
# resident set follows its live tensors (as helpers.memory's fresh-process measurements do): pass as launch(env=...).
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


def _dump_stacks(proc: subprocess.Popen, wait_s: float = 15.0) -> tuple[int, int]:
    """Ask every worker that can (faulthandler on SIGUSR1, registered by `setup`) to print its stack, and wait until
    as many stacks have arrived, or `wait_s` passed (a loaded machine may take a while to schedule them); the pipe
    keeps what was read for the next `communicate`. Returns (workers that were asked, workers)."""
    workers = _descendants(proc.pid) or []
    if not hasattr(signal, "SIGUSR1"):
        return 0, len(workers)
    ready = [pid for pid in workers if _catches(pid, signal.SIGUSR1)]
    for pid in ready:
        try:
            os.kill(pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    output, deadline = "", time.monotonic() + wait_s
    while ready and time.monotonic() < deadline:
        try:
            proc.communicate(timeout=0.5)
            break  # the run ended by itself
        except subprocess.TimeoutExpired as partial:
            output = (partial.output or b"").decode(errors="replace")
        if len(re.findall(r"^(?:Current thread|Thread) 0x", output, flags=re.M)) >= len(ready):
            time.sleep(0.5)  # the rest of the last stack
            break
    return len(ready), len(workers)


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


def hang_report(output: str, max_chars: int = 6000) -> str:
    """The stacks the workers dumped on SIGUSR1 (faulthandler's "Thread 0x..." blocks, the waiting frame
    first), or the end of the output when there are none."""
    found = [i for i in (output.find("Thread 0x"), output.find("Current thread 0x")) if i >= 0]
    return output[min(found) : min(found) + max_chars] if found else output[-3000:]


def launch(script: str | Path, args: Sequence[object] = (), nproc: int = 2, timeout: float = 300, threads: int = 1,
           env: dict[str, str] | None = None) -> str:
    """Run `script` on `nproc` processes under torchrun and return its output (stdout and stderr interleaved).

    Each worker gets `threads` intra-op threads (OMP_NUM_THREADS), so `nproc` workers do not oversubscribe the
    cores. Raises DistributedRunError on a non-zero exit or when `timeout` seconds pass.
    """
    script = Path(script)
    if not script.is_file():
        raise DistributedRunError(f"no script at {script}; pass the path of a script that calls "
                                  "helpers.distributed.setup")
    if nproc < 1:
        raise ValueError(f"nproc must be 1 or more, got {nproc}")
    child_env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.Popen(torchrun_command(script, list(args), nproc), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=child_env)
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        asked, workers = _dump_stacks(proc)
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
            f"{hang_report(output)}"
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


def chapter_script(name: str, chapter: str = "ch07_parallel") -> Path:
    """A chapter's script: next to the notebook (a notebook runs in its own folder), or in the clone `helpers`
    was installed from. A notebook opened alone (e.g. on Colab) needs the repository for its scripts."""
    here = Path.cwd()
    for candidate in (here / name, here / chapter / name, Path(__file__).resolve().parents[1] / chapter / name):
        if candidate.is_file():
            return candidate
    from .notebooks import REPOSITORY_URL

    raise FileNotFoundError(f"{chapter}/{name} was not found: the chapter's scripts come with the repository. "
                            f"Clone it (git clone {REPOSITORY_URL}) and run the notebook from its {chapter}/ folder")


# ---- inside a script: the process group ----


@dataclass(frozen=True)
class Runtime:
    """What a rank knows about the run it is part of."""

    rank: int
    world_size: int
    device: torch.device
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_device_type(requested: str, local_world_size: int, cuda_count: int) -> str:
    """"cuda" when every local rank gets its own GPU (NCCL cannot put two ranks on one GPU), else "cpu".

    `requested` "auto" decides by the GPUs present; "cuda" with too few GPUs is an error, not a quiet switch.
    """
    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu or cuda, got {requested!r}")
    if requested == "cuda" and cuda_count < local_world_size:
        raise RuntimeError(f"--device cuda needs one GPU per process: {local_world_size} processes, {cuda_count} "
                           "GPU(s); launch fewer processes (--nproc-per-node) or use --device cpu (gloo)")
    if requested == "auto":
        return "cuda" if cuda_count >= local_world_size else "cpu"
    return requested


def setup(device: str = "auto", timeout_s: float = 120) -> Runtime:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, MASTER_ADDR, ...).

    A collective that waits longer than `timeout_s` raises in the rank instead of blocking forever.
    """
    if hasattr(signal, "SIGUSR1"):  # `launch` sends it to a run that timed out: print where this rank waits
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    if "RANK" not in os.environ:
        raise RuntimeError("this script runs under torchrun: python -m torch.distributed.run --standalone "
                           "--nproc-per-node 2 SCRIPT ... (or helpers.distributed.launch from Python)")
    local_rank, local_world = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    device_type = pick_device_type(device, local_world, cuda_count)
    if device == "auto" and device_type == "cpu" and cuda_count and local_rank == 0:
        print(f"{local_world} processes but {cuda_count} GPU(s): running on CPU with gloo (--device cpu to silence "
              "this; launch one process per GPU to use NCCL)", flush=True)
    if device_type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
        torch.backends.cuda.matmul.allow_tf32 = False  # fp32 comparisons with the single-process model
        torch.backends.cudnn.allow_tf32 = False
        dist.init_process_group("nccl", timeout=timedelta(seconds=timeout_s), device_id=dev)
    else:
        dev = torch.device("cpu")
        dist.init_process_group("gloo", timeout=timedelta(seconds=timeout_s))
    return Runtime(dist.get_rank(), dist.get_world_size(), dev, dist.get_backend())


def teardown() -> None:
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


# ---- communication accounting ----


def ring_all_reduce_bytes(nbytes: float, world_size: int) -> float:
    """Bytes each rank sends in a ring all-reduce of `nbytes`: a reduce-scatter and an all-gather, each
    (p-1) steps of a 1/p chunk, so 2(p-1)/p x nbytes, almost independent of p."""
    return 2 * (world_size - 1) / world_size * nbytes


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of the gradients DDP synchronises: every trainable parameter once (tied weights are one tensor)."""
    return sum(tensor_bytes(p) for p in model.parameters() if p.requires_grad)


def bytes_written() -> int | None:
    """Bytes this process has written through write-like system calls, sockets included (Linux `wchar`).

    gloo moves tensors over TCP sockets, so around a collective the difference is what this rank sent (do not
    print or save files in between). None where /proc/self/io does not exist (macOS, Windows).
    """
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("wchar:"):
                return int(line.split()[1])
    except OSError:
        pass
    return None


def ring_all_reduce(tensor: torch.Tensor, group: dist.ProcessGroup | None = None) -> int:
    """Sum `tensor` over the ranks in place with a ring of send/recv; returns the bytes this rank sent.

    The flat tensor is cut into p chunks. Reduce-scatter: in step s rank r sends chunk (r - s) to its right
    neighbour and adds the chunk arriving from its left, so after p-1 steps rank r holds the full sum of chunk
    (r + 1). All-gather: p-1 more steps pass the finished chunks around the ring.
    """
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if world == 1:
        return 0
    flat = tensor.view(-1)
    chunks = list(flat.tensor_split(world))
    right = dist.get_global_rank(group, (rank + 1) % world) if group else (rank + 1) % world
    left = dist.get_global_rank(group, (rank - 1) % world) if group else (rank - 1) % world
    sent = 0
    for phase in ("reduce-scatter", "all-gather"):
        for step in range(world - 1):
            if phase == "reduce-scatter":
                send_idx, recv_idx = (rank - step) % world, (rank - step - 1) % world
            else:
                send_idx, recv_idx = (rank + 1 - step) % world, (rank - step) % world
            incoming = torch.empty_like(chunks[recv_idx])
            ops = [dist.P2POp(dist.isend, chunks[send_idx].contiguous(), right, group),
                   dist.P2POp(dist.irecv, incoming, left, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()
            sent += tensor_bytes(chunks[send_idx])
            if phase == "reduce-scatter":
                chunks[recv_idx].add_(incoming)
            else:
                chunks[recv_idx].copy_(incoming)
    return sent


@dataclass
class CommLog:
    """What one rank handed to its collectives (count and bytes), optionally what the ring algorithm sent."""

    calls: int = 0
    bytes: int = 0
    bytes_sent: int = 0

    def reset(self) -> None:
        self.calls = self.bytes = self.bytes_sent = 0


def counting_allreduce_hook(log: CommLog, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: DDP's own behaviour (average the bucket with all_reduce), with its size logged."""
    buffer = bucket.buffer()
    log.calls += 1
    log.bytes += tensor_bytes(buffer)
    buffer.div_(dist.get_world_size())
    work = dist.all_reduce(buffer, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def ring_allreduce_hook(log: CommLog, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook that averages each bucket with our send/recv `ring_all_reduce`."""
    buffer = bucket.buffer()
    log.calls += 1
    log.bytes += tensor_bytes(buffer)
    buffer.div_(dist.get_world_size())
    log.bytes_sent += ring_all_reduce(buffer)
    done: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    done.set_result(buffer)
    return done


# ---- comparing with the single-process model ----


def max_over_ranks(value: float, device: torch.device) -> float:
    """The largest of every rank's `value` (e.g. each rank's error on its own shard)."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().double() - b.detach().double().to(a.device)).abs().max().item()


def max_param_diff(model: nn.Module, reference: nn.Module) -> float:
    """Largest |difference| between same-named parameters of two copies of a model (plain tensors)."""
    ref = dict(reference.named_parameters())
    return max(max_abs_diff(p, ref[name]) for name, p in model.named_parameters())


# ---- the scripts' shared command line and results ----


def add_common_args(parser: argparse.ArgumentParser) -> None:
    """Model size (a preset with fields overridden), device, seed, collective timeout, output JSON."""
    parser.add_argument("--out", type=Path, required=True, help="JSON file rank 0 writes its results to")
    parser.add_argument("--preset", default="gpt-smoke", help="helpers.PRESETS name the model starts from")
    parser.add_argument("--layers", type=int, help="n_layers (default: the preset's)")
    parser.add_argument("--d-model", type=int, help="d_model (default: the preset's)")
    parser.add_argument("--heads", type=int, help="n_heads (default: the preset's)")
    parser.add_argument("--context", type=int, help="context_length (default: the preset's)")
    parser.add_argument("--vocab", type=int, help="vocab_size; token ids are taken modulo it (default: the preset's)")
    parser.add_argument("--ffn", choices=["gelu", "swiglu"], help="feed-forward type (default: the preset's)")
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                        help="auto: one GPU per process when there are enough, else CPU with gloo")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=120, help="seconds a collective may wait before it fails")


def add_dtype_arg(parser: argparse.ArgumentParser) -> None:
    """--dtype of the weights, for the scripts that compare optimizer steps with one process."""
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                        help="float64 makes the comparison with one process exact: Adam divides by sqrt(v), so in "
                             "float32 a rounding difference in a near-zero gradient can change an update completely")


def config_from_args(args: argparse.Namespace) -> GPTConfig:
    """The preset with the command line's overrides; dropout off, so every variant computes the same function."""
    overrides = {"n_layers": args.layers, "d_model": args.d_model, "n_heads": args.heads,
                 "context_length": args.context, "vocab_size": args.vocab, "ffn_type": args.ffn}
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return GPTConfig.from_preset(args.preset, dropout=0.0, **overrides)


def rank_batches(dataset: Dataset, world_size: int, rank: int, batch: int, seed: int, n_batches: int) -> list:
    """The first `n_batches` batches rank `rank` reads: a DistributedSampler gives it every world_size-th window
    of a seeded shuffle. Rank 0 calls this for every rank to rebuild the concatenated batches of the reference."""
    sampler = DistributedSampler(dataset, num_replicas=world_size, rank=rank, shuffle=True, seed=seed,
                                 drop_last=True)
    sampler.set_epoch(0)
    batches = []
    for xy in DataLoader(dataset, batch_size=batch, sampler=sampler, drop_last=True):
        if len(batches) == n_batches:
            break
        batches.append(xy)
    if len(batches) < n_batches:
        raise ValueError(f"the corpus gives each rank only {len(batches)} batches of {batch}; "
                         "use fewer steps, fewer micro-batches or a smaller batch")
    return batches


def token_ids(vocab_size: int) -> torch.Tensor:
    """The course corpus as GPT-2 ids, folded into a smaller vocabulary (id mod vocab_size) for tiny models."""
    from .data import load_token_ids

    return load_token_ids() % vocab_size


def run_info(runtime: Runtime, config: GPTConfig, **fields) -> dict:
    """The header every script's JSON starts with: who ran what, where."""
    device_name = torch.cuda.get_device_name(runtime.device) if runtime.device.type == "cuda" else "cpu"
    return {"world_size": runtime.world_size, "backend": runtime.backend, "device": device_name,
            "torch": torch.__version__, "config": dataclasses.asdict(config), **fields}


def write_json(runtime: Runtime, path: Path, results: dict) -> None:
    """Rank 0 writes the results (atomically, so a reader never sees half a file)."""
    if not runtime.is_main:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".part")
    tmp.write_text(json.dumps(results, indent=2))
    os.replace(tmp, path)
