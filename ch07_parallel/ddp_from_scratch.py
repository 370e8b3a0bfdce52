"""Data parallelism by hand (three ways to average the gradients) against DistributedDataParallel, then ZeRO-1.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ch07_parallel/ddp_from_scratch.py --out r.json

Every rank trains a replica of the GPT on its own part of each batch (SGD with momentum) and averages the
gradients with one of `helpers.parallel.data_parallel`'s wrappers, or with torch's DDP as the reference:

* per_parameter: one all_reduce per parameter after backward;
* flat_buffer: the gradients are views of one flat buffer, all-reduced once after backward;
* bucketed_blocking / bucketed_overlap: the same buckets (backward order, --bucket-mb), all-reduced one by one
  after backward, or each launched from the gradient hooks as soon as it is complete, during backward.

Rank 0 checks every version's final parameters against one process trained on the concatenated batches. The
step time is timed interleaved: round r runs one step of every version (in a rotating order), after --warmup
untimed rounds; reported as the median and quartiles of rank 0's --steps timed steps, with the all_reduce calls
and bytes per step and, for the hand-written versions, the communication left after backward ("exposed": from
backward's end until the gradients are averaged) and when each bucket was launched. A run with gradient
accumulation (no_sync on all micro-batches but the last) checks that only the last one communicates.

Then ZeRO-1 (`helpers.parallel.zero.ZeroRedundancyAdamW`) against DDP with AdamW: both against one process
with AdamW, and the AdamW moment bytes each rank holds. Rank 0 writes the results as JSON to --out. Runs on CPU
(gloo) and on one GPU per process (NCCL).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.measure.timing import Spread
from helpers.model.gpt import GPT
from helpers.parallel.comm import CommLog, counting_allreduce_hook, gradient_bytes
from helpers.parallel.data_parallel import BucketedOverlapDDP, FlatBufferAllReduce, PerParameterAllReduce
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
from helpers.parallel.zero import ZeroRedundancyAdamW, adam_moment_bytes, shard_range
from helpers.system.args import positive_float, positive_int
from helpers.system.device import parse_dtype, synchronize
from helpers.text.data import NextTokenDataset
from helpers.training.step import lm_loss

VERSIONS = ("torch_ddp", "per_parameter", "flat_buffer", "bucketed_blocking", "bucketed_overlap")
SGD = dict(lr=0.1, momentum=0.9)
ADAMW = dict(lr=1e-3, weight_decay=0.1)


def torch_ddp(model: GPT, runtime, bucket_mb: float) -> DDP:
    device = runtime.device
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, bucket_cap_mb=bucket_mb)


def hand_written(name: str, model: GPT, bucket_mb: float):
    if name == "per_parameter":
        return PerParameterAllReduce(model)
    if name == "flat_buffer":
        return FlatBufferAllReduce(model)
    return BucketedOverlapDDP(model, bucket_mb, overlap=name == "bucketed_overlap")


def make_step(name: str, base: GPT, runtime, bucket_mb: float):
    """(the replica's GPT, its wrapper, a function that trains one step on (x, y) and returns what it
    communicated)."""
    model = copy.deepcopy(base).to(runtime.device)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    if name == "torch_ddp":
        ddp, log = torch_ddp(model, runtime, bucket_mb), CommLog()
        ddp.register_comm_hook(log, counting_allreduce_hook)  # DDP's own all_reduce, counted

        def ddp_step(x, y) -> dict:
            log.reset()
            lm_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            return {"calls": log.calls, "bytes": log.bytes}

        return model, ddp, ddp_step
    wrapper = hand_written(name, model, bucket_mb)

    def step(x, y) -> dict:
        wrapper.zero_grad()
        start = time.perf_counter()
        loss = lm_loss(wrapper(x), y)
        backward_start = time.perf_counter()
        loss.backward()
        wrapper.finish()
        opt.step()
        log = wrapper.log
        timeline = {"backward_start": backward_start, "backward_end": log.backward_end, "finished": log.finished,
                    "launched": log.launched, "completed": log.completed}
        return {"calls": log.calls, "bytes": log.bytes, "exposed_s": log.exposed_s,
                "backward_s": log.backward_end - backward_start,
                "launched_before_backward_end": log.launched_before_backward_end, "sizes": log.sizes,
                "timeline": {k: [t - start for t in v] if isinstance(v, list) else v - start
                             for k, v in timeline.items()}}

    return model, wrapper, step


def accumulation_run(base: GPT, batches: list, accum: int, runtime, bucket_mb: float) -> tuple[GPT, list]:
    """The bucketed wrapper over `accum` micro-batches per step, no_sync on all but the last; (model, calls and
    bytes per step)."""
    model = copy.deepcopy(base).to(runtime.device)
    wrapper = BucketedOverlapDDP(model, bucket_mb)
    opt = torch.optim.SGD(model.parameters(), **SGD)
    comm = []
    for step in range(len(batches) // accum):
        wrapper.zero_grad()
        for micro in range(accum):
            x, y = (t.to(runtime.device) for t in batches[step * accum + micro])
            if micro < accum - 1:
                with wrapper.no_sync():
                    (lm_loss(wrapper(x), y) / accum).backward()
                    wrapper.finish()  # does nothing inside no_sync
            else:
                (lm_loss(wrapper(x), y) / accum).backward()
                wrapper.finish()
        opt.step()
        comm.append({"calls": wrapper.log.calls, "bytes": wrapper.log.bytes})
    return model, comm


def train_reference(base: GPT, steps: list[list], device: torch.device, optimizer: str) -> GPT:
    """One process, one batch per step: the concatenation of every rank's (micro-)batches of that step."""
    model = copy.deepcopy(base).to(device)
    opt = (torch.optim.SGD(model.parameters(), **SGD) if optimizer == "sgd"
           else torch.optim.AdamW(model.parameters(), **ADAMW))
    for parts in steps:
        x = torch.cat([p[0] for p in parts]).to(device)
        y = torch.cat([p[1] for p in parts]).to(device)
        lm_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model


def zero_vs_ddp(base: GPT, batches: list, runtime, bucket_mb: float) -> dict:
    """AdamW steps with DDP (every rank all the moments) and with ZeRO-1 (each rank its shard's); the models and
    each rank's moment bytes."""
    device = runtime.device
    ddp_model = copy.deepcopy(base).to(device)
    ddp = torch_ddp(ddp_model, runtime, bucket_mb)
    ddp_opt = torch.optim.AdamW(ddp.parameters(), **ADAMW)
    zero_model = copy.deepcopy(base).to(device)
    zero = ZeroRedundancyAdamW(zero_model.parameters(), **ADAMW)
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        lm_loss(ddp(x), y).backward()
        ddp_opt.step()
        ddp_opt.zero_grad(set_to_none=True)
        zero.zero_grad()
        lm_loss(zero_model(x), y).backward()
        zero.step()
    per_rank = [None] * runtime.world_size
    dist.all_gather_object(per_rank, {"ddp_state_bytes": adam_moment_bytes(ddp_opt),
                                      "zero_state_bytes": zero.state_bytes(), "shard": [zero.start, zero.stop]})
    return {"models": {"ddp_adamw": ddp_model, "zero1": zero_model}, "per_rank": per_rank,
            "flat_numel": zero.numel, "padded_numel": zero.flat_params.numel()}


def overlap_summary(runs: list[dict]) -> dict:
    """The bucketed overlap figures over the timed steps."""
    return {"launched_before_backward_end": statistics.median(r["launched_before_backward_end"] for r in runs),
            "first_launch_in_backward": statistics.median(
                (r["timeline"]["launched"][0] - r["timeline"]["backward_start"]) / r["backward_s"] for r in runs),
            "timelines": [r["timeline"] for r in runs], "bucket_bytes": runs[0]["sizes"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_dtype_arg(parser)
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=positive_int, default=10, help="timed steps of every version")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds before them")
    parser.add_argument("--bucket-mb", type=positive_float, default=0.25,
                        help="bucket size in MiB, ours and DDP's (DDP's default is 25; small so a tiny model has "
                             "several buckets)")
    parser.add_argument("--accumulation", type=positive_int, default=2, help="micro-batches per step, no_sync run")
    parser.add_argument("--accumulation-steps", type=positive_int, default=2, help="optimizer steps, no_sync run")
    parser.add_argument("--zero-steps", type=positive_int, default=3, help="AdamW steps, ZeRO-1 against DDP")
    args = parser.parse_args()
    if args.warmup < 0:
        parser.error(f"--warmup must be 0 or more, got {args.warmup}")

    runtime = setup(args.device, args.timeout)
    rank, world, device = runtime.rank, runtime.world_size, runtime.device
    config = config_from_args(args)
    torch.manual_seed(args.seed)
    base = GPT(config).to(parse_dtype(args.dtype))  # the same seed on every rank; the wrappers broadcast rank 0's
    dataset = NextTokenDataset(token_ids(config.vocab_size), config.context_length)
    rounds = args.warmup + args.steps
    accum_micro = args.accumulation * args.accumulation_steps
    n_batches = max(rounds, accum_micro, args.zero_steps)
    all_batches = [rank_batches(dataset, world, r, args.batch, args.seed, n_batches) for r in range(world)]
    mine = [(x.to(device), y.to(device)) for x, y in all_batches[rank]]

    trained, wrappers, steps = {}, {}, {}
    for name in VERSIONS:
        trained[name], wrappers[name], steps[name] = make_step(name, base, runtime, args.bucket_mb)
    seconds = {name: [] for name in VERSIONS}
    comm = {name: [] for name in VERSIONS}
    for r in range(rounds):
        shift = r % len(VERSIONS)  # a rotating order: no version always runs first after the barrier
        for name in VERSIONS[shift:] + VERSIONS[:shift]:
            dist.barrier()
            start = time.perf_counter()
            info = steps[name](*mine[r])
            synchronize(device)
            elapsed = time.perf_counter() - start
            if r >= args.warmup:
                seconds[name].append(elapsed)
                comm[name].append(info)

    results = run_info(runtime, config, dtype=args.dtype, batch_per_rank=args.batch, steps=args.steps,
                       warmup=args.warmup, bucket_mb=args.bucket_mb, accumulation=args.accumulation,
                       accumulation_steps=args.accumulation_steps, zero_steps=args.zero_steps,
                       parameters=base.num_parameters(), parameter_tensors=len(list(base.parameters())),
                       gradient_bytes=gradient_bytes(base))
    names = {id(p): n for n, p in trained["bucketed_overlap"].named_parameters()}
    results["buckets"] = [[names[id(p)] for p in bucket] for bucket in wrappers["bucketed_overlap"].buckets]
    for name in VERSIONS:
        per_rank = [None] * world
        dist.all_gather_object(per_rank, {"calls": [c["calls"] for c in comm[name]],
                                          "bytes": [c["bytes"] for c in comm[name]]})
        results[name] = {"step_s": Spread(tuple(seconds[name])).summary(), "step_samples": seconds[name],
                         "per_rank": per_rank}
        if name != "torch_ddp":
            results[name]["exposed_s"] = Spread(tuple(c["exposed_s"] for c in comm[name])).summary()
            results[name]["backward_s"] = Spread(tuple(c["backward_s"] for c in comm[name])).summary()
    results["bucketed_overlap"]["overlap"] = overlap_summary(comm["bucketed_overlap"])

    accum_model, accum_comm = accumulation_run(base, all_batches[rank][:accum_micro], args.accumulation, runtime,
                                               args.bucket_mb)
    per_rank = [None] * world
    dist.all_gather_object(per_rank, accum_comm)
    results["bucketed_accumulation"] = {"per_rank": per_rank}

    zero = zero_vs_ddp(base, all_batches[rank][: args.zero_steps], runtime, args.bucket_mb)
    expected = [shard_range(zero["flat_numel"], world, r) for r in range(world)]
    results["zero"] = {"per_rank": zero["per_rank"], "flat_numel": zero["flat_numel"],
                       "padded_numel": zero["padded_numel"], "expected_shards": expected}

    if runtime.is_main:
        initial = base.to(device)
        one_step = [[all_batches[r][s] for r in range(world)] for s in range(n_batches)]
        references = {
            "sgd": train_reference(base, one_step[:rounds], device, "sgd"),
            "accum": train_reference(base, [[all_batches[r][s * args.accumulation + m] for r in range(world)
                                             for m in range(args.accumulation)]
                                            for s in range(args.accumulation_steps)], device, "sgd"),
            "adamw": train_reference(base, one_step[: args.zero_steps], device, "adamw"),
        }
        checks = [(results[name], trained[name], "sgd") for name in VERSIONS]
        checks.append((results["bucketed_accumulation"], accum_model, "accum"))
        for name, model in zero["models"].items():
            results["zero"][name] = {}
            checks.append((results["zero"][name], model, "adamw"))
        for entry, model, reference in checks:
            entry.update(max_param_diff=max_param_diff(model, references[reference]),
                         max_param_change=max_param_diff(references[reference], initial))
        results["zero"]["zero1_vs_ddp_adamw"] = max(
            max_abs_diff(p, q) for p, q in zip(zero["models"]["zero1"].parameters(),
                                               zero["models"]["ddp_adamw"].parameters(), strict=True))
    write_json(runtime, args.out, results)
    finish_and_exit()


if __name__ == "__main__":
    main()
