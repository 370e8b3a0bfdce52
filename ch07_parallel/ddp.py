"""Data parallelism with DistributedDataParallel: every rank holds the whole model and its own shard of the data.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ch07_parallel/ddp.py --out results/ddp.json

Each rank reads a different part of each batch (DistributedSampler); after backward, DDP averages the gradients
over the ranks with all-reduce (in buckets, overlapped with the backward), so every replica takes the same step.
This script trains the GPT that way (SGD with momentum) and checks, on rank 0, that the parameters equal those
of one process trained on the concatenated batches; one more run does the same with AdamW, whose division by
each gradient's running RMS magnifies rounding differences where gradients are tiny. It also

* accumulates gradients over several micro-batches with `no_sync` (one all-reduce per optimizer step instead of
  one per micro-batch) and without it, with the same result;
* counts the bytes DDP hands to all_reduce per step (a communication hook) against the gradient bytes, the
  analytic ring all-reduce volume 2(p-1)/p x gradient bytes, the bytes the process really wrote to its sockets
  (gloo on Linux) and the bytes our own send/recv ring all-reduce sent.

Rank 0 writes the results as JSON to --out. Runs on CPU (gloo) and on one GPU per process (NCCL).
"""

from __future__ import annotations

import argparse
import copy
from contextlib import nullcontext

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.model.gpt import GPT
from helpers.parallel.comm import (
    CommLog,
    bytes_written,
    counting_allreduce_hook,
    gradient_bytes,
    ring_all_reduce_bytes,
    ring_allreduce_hook,
)
from helpers.parallel.runtime import (
    add_common_args,
    add_dtype_arg,
    config_from_args,
    finish_and_exit,
    max_abs_diff,
    max_param_diff,
    rank_batches,
    run_info,
    setup,
    token_ids,
    write_json,
)
from helpers.system.args import positive_float, positive_int
from helpers.system.device import parse_dtype
from helpers.text.data import NextTokenDataset
from helpers.training.step import lm_loss

OPTIMIZERS = {  # the comparisons use SGD; one run shows what AdamW does to the same rounding differences
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1),
}


def train_ddp(base: GPT, batches: list, accum: int, hook, sync_each_micro: bool, optimizer: str, runtime,
              bucket_mb: float) -> dict:
    """Optimizer steps of a DDP replica; each step accumulates `accum` micro-batches. Logs the bytes handed to
    all_reduce and the bytes written to sockets in each step."""
    device = runtime.device
    model = DDP(copy.deepcopy(base).to(device), device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=bucket_mb)
    log = CommLog()
    model.register_comm_hook(log, hook)
    opt = OPTIMIZERS[optimizer](model.parameters())
    handed, calls, sent_ring, written, losses = [], [], [], [], []
    for step in range(len(batches) // accum):
        log.reset()
        dist.barrier()
        w0 = bytes_written()
        step_loss = 0.0
        for micro in range(accum):
            x, y = (t.to(device) for t in batches[step * accum + micro])
            last = micro == accum - 1
            with nullcontext() if (last or sync_each_micro) else model.no_sync():
                loss = lm_loss(model(x), y) / accum
                loss.backward()
            step_loss += loss.item()
        opt.step()
        opt.zero_grad(set_to_none=True)
        w1 = bytes_written()
        written.append(None if w0 is None or runtime.backend != "gloo" else w1 - w0)
        handed.append(log.bytes)
        calls.append(log.calls)
        sent_ring.append(log.bytes_sent)
        losses.append(step_loss)
    return {"model": model.module, "bytes_handed": handed, "allreduce_calls": calls, "ring_bytes_sent": sent_ring,
            "bytes_written": written, "losses": losses}


def train_reference(base: GPT, steps: list[list], device: torch.device, optimizer: str) -> GPT:
    """One process, one batch per step: the concatenation of every rank's micro-batches of that step."""
    model = copy.deepcopy(base).to(device)
    opt = OPTIMIZERS[optimizer](model.parameters())
    for parts in steps:
        x = torch.cat([p[0] for p in parts]).to(device)
        y = torch.cat([p[1] for p in parts]).to(device)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_dtype_arg(parser)
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per rank per micro-batch")
    parser.add_argument("--steps", type=positive_int, default=3, help="optimizer steps")
    parser.add_argument("--accumulation", type=positive_int, default=2,
                        help="micro-batches per step in the accumulation runs")
    parser.add_argument("--bucket-mb", type=positive_float, default=0.25,
                        help="DDP bucket size in MiB (DDP's default is 25; small here so a tiny model has buckets)")
    args = parser.parse_args()

    runtime = setup(args.device, args.timeout)
    rank, world, device = runtime.rank, runtime.world_size, runtime.device
    config = config_from_args(args)
    torch.manual_seed(args.seed)
    # the same seed on every rank; DDP also broadcasts rank 0's weights at construction
    base = GPT(config).to(parse_dtype(args.dtype))
    dataset = NextTokenDataset(token_ids(config.vocab_size), config.context_length)
    n_micro = args.steps * args.accumulation
    all_batches = [rank_batches(dataset, world, r, args.batch, args.seed, n_micro) for r in range(world)]
    mine = all_batches[rank]
    grad_bytes = gradient_bytes(base)

    sgd = dict(hook=counting_allreduce_hook, sync_each_micro=False, optimizer="sgd")
    runs = {
        "ddp": dict(sgd, batches=mine[: args.steps], accum=1),
        "ddp_ring": dict(sgd, batches=mine[: args.steps], accum=1, hook=ring_allreduce_hook),
        "accum_no_sync": dict(sgd, batches=mine, accum=args.accumulation),
        "accum_sync_every_micro": dict(sgd, batches=mine, accum=args.accumulation, sync_each_micro=True),
        "ddp_adamw": dict(sgd, batches=mine[: args.steps], accum=1, optimizer="adamw"),
    }
    trained = {name: train_ddp(base, runtime=runtime, bucket_mb=args.bucket_mb, **run) for name, run in runs.items()}

    results = run_info(runtime, config, dtype=args.dtype, batch_per_rank=args.batch, steps=args.steps,
                       accum=args.accumulation,
                       bucket_mb=args.bucket_mb, parameters=base.num_parameters(), gradient_bytes=grad_bytes,
                       ring_bytes_per_rank=ring_all_reduce_bytes(grad_bytes, world))
    # Every rank's byte counts, so the notebook can show that each rank sends the same amount.
    for name, run in trained.items():
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {k: run[k] for k in ("bytes_handed", "allreduce_calls",
                                                               "ring_bytes_sent", "bytes_written")})
        results[name] = {"per_rank": per_rank, "losses": run["losses"], "optimizer": runs[name]["optimizer"]}

    if runtime.is_main:
        one_step = [[all_batches[r][s] for r in range(world)] for s in range(args.steps)]
        accum = args.accumulation
        accum_steps = [[all_batches[r][s * accum + m] for r in range(world) for m in range(accum)]
                       for s in range(args.steps)]
        references = {(steps, opt): train_reference(base, batches, device, opt)
                      for steps, batches, opt in (("one", one_step, "sgd"), ("accum", accum_steps, "sgd"),
                                                  ("one", one_step, "adamw"))}
        initial = base.to(device)
        for name, run in runs.items():
            ref = references["accum" if name.startswith("accum") else "one", run["optimizer"]]
            diffs = {n: max_abs_diff(p, dict(ref.named_parameters())[n])
                     for n, p in trained[name]["model"].named_parameters()}
            worst = max(diffs, key=diffs.get)
            results[name].update(max_param_diff=diffs[worst], worst_parameter=worst,
                                 max_param_change=max_param_diff(ref, initial))  # how far training moved them
    write_json(runtime, args.out, results)
    finish_and_exit()


if __name__ == "__main__":
    main()
