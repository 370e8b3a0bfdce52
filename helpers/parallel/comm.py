"""What processes send to each other: the ring all-reduce's analytic volume, a DDP communication hook that
counts the bytes DDP hands to `all_reduce`, a ring all-reduce written with send/recv that counts what it sends,
and the bytes the process really wrote to its sockets (`/proc/self/io`, gloo on Linux).
"""

# No `from __future__ import annotations`: DDP checks the communication hooks' annotations at runtime.
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


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
