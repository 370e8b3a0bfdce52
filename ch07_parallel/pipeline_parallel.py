"""Pipeline parallelism: the GPT's layers cut into one stage per rank, micro-batches flowing through them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ch07_parallel/pipeline_parallel.py --out pp.json

1. GPipe from scratch (`helpers.parallel.pipeline.gpipe_step`, blocking send/recv), then
   `torch.distributed.pipelining`'s `ScheduleGPipe` and `Schedule1F1B` on the same stage modules: every stage's
   gradients and the loss compared with the single-process model on the whole batch (each rank recomputes the
   reference for its own stage).
2. The bubble: for several micro-batch counts m (same global batch), the idle fraction of the from-scratch GPipe
   step, measured from each rank's compute intervals, against (p-1)/(m+p-1); the step time of the two library
   schedules beside it.
3. The activations and gradients sent between stages per step, counted and (gloo on Linux) measured.

The loss function is given to the schedules on every rank: a rank built without it never runs the backward its
neighbours wait for, and the run hangs. Rank 0 writes JSON to --out.
"""

import argparse
import copy
import statistics
import time

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from helpers.model.gpt import GPT
from helpers.parallel.comm import bytes_written, ring_all_reduce_bytes
from helpers.parallel.pipeline import (
    Event,
    bubble_fraction,
    full_name,
    gpipe_step,
    is_first_stage,
    is_last_stage,
    measured_bubble,
    pipeline_stage,
    stage_layers,
    sync_tied_gradients,
    tied_group,
)
from helpers.parallel.runtime import (
    add_common_args,
    config_from_args,
    finish_and_exit,
    max_abs_diff,
    max_over_ranks,
    run_info,
    setup,
    write_json,
)
from helpers.system.args import positive_int
from helpers.system.device import synchronize
from helpers.training.step import lm_loss

SCHEDULES = {"ScheduleGPipe": ScheduleGPipe, "Schedule1F1B": Schedule1F1B}


def grad_diff(stage: GPT, ref_grads: dict[str, torch.Tensor]) -> float:
    return max(max_abs_diff(p.grad, ref_grads[full_name(stage, n)]) for n, p in stage.named_parameters())


def common_clock(device: torch.device) -> float:
    """Rank 0's perf_counter after a barrier, shared by all: ranks on one machine read the same monotonic clock."""
    dist.barrier()
    t0 = torch.tensor([time.perf_counter()], dtype=torch.float64, device=device)
    dist.broadcast(t0, 0)
    return t0.item()


class Pipeline:
    """This rank's stage of the GPT, with the inputs and targets of one global batch."""

    def __init__(self, base: GPT, runtime, x: torch.Tensor, y: torch.Tensor):
        self.base, self.runtime, self.x, self.y = base, runtime, x, y
        self.rank, self.world, self.device = runtime.rank, runtime.world_size, runtime.device
        self.group = tied_group(self.world)

    def fresh_stage(self) -> GPT:
        return pipeline_stage(self.base, self.rank, self.world).to(self.device)

    def scratch_step(self, stage: GPT, m: int, t0: float | None = None, sync_tied: bool = True):
        shape = (self.x.size(0) // m, self.x.size(1), self.base.config.d_model)
        losses, events = gpipe_step(stage, self.x if is_first_stage(stage) else None,
                                    self.y if is_last_stage(stage) else None,
                                    m, lm_loss, shape, self.rank, t0)
        if sync_tied:
            sync_tied_gradients(stage, self.group)
        return losses, events

    def library_schedule(self, name: str, stage: GPT, m: int):
        pipe_stage = PipelineStage(stage, self.rank, self.world, self.device)
        return SCHEDULES[name](pipe_stage, n_microbatches=m, loss_fn=lm_loss)  # loss_fn on every rank

    def library_step(self, schedule, stage: GPT) -> list[float]:
        losses = []
        if is_first_stage(stage):
            schedule.step(self.x)
        elif is_last_stage(stage):
            schedule.step(target=self.y, losses=losses)
        else:
            schedule.step()
        sync_tied_gradients(stage, self.group)
        return [loss.item() for loss in losses]


def check_equal(pipe: Pipeline, m: int, ref_grads, ref_loss: float) -> dict:
    """Gradients and loss of each implementation against the single-process model."""
    out = {}
    stage = pipe.fresh_stage()
    dist.barrier()
    w0 = bytes_written()
    losses, _ = pipe.scratch_step(stage, m, sync_tied=False)
    w1 = bytes_written()
    sync_tied_gradients(stage, pipe.group)
    w2 = bytes_written()
    out["from_scratch_gpipe"] = {"grad_max_diff": max_over_ranks(grad_diff(stage, ref_grads), pipe.device),
                                 "losses": losses}
    gloo = pipe.runtime.backend == "gloo" and w0 is not None
    written = [None] * pipe.world
    dist.all_gather_object(written, {"send_recv": w1 - w0, "tied_allreduce": w2 - w1} if gloo else None)
    out["from_scratch_gpipe"]["bytes_written_per_rank"] = written
    for name in SCHEDULES:
        stage = pipe.fresh_stage()
        losses = pipe.library_step(pipe.library_schedule(name, stage, m), stage)
        out[name] = {"grad_max_diff": max_over_ranks(grad_diff(stage, ref_grads), pipe.device), "losses": losses}
    for result in out.values():  # the last rank holds the losses: share their mean with rank 0
        mean = torch.tensor([statistics.fmean(result["losses"]) if result["losses"] else 0.0], device=pipe.device)
        dist.broadcast(mean, pipe.world - 1)
        result["loss_diff"] = abs(mean.item() - ref_loss)
        del result["losses"]
    return out


def bubble_sweep(pipe: Pipeline, micro_counts: list[int], repeats: int) -> list[dict]:
    """Measured idle fraction and step time per micro-batch count (medians over `repeats` steps)."""
    rows = []
    stage = pipe.fresh_stage()
    for m in micro_counts:
        pipe.scratch_step(stage, m)  # warm-up
        bubbles, seconds, timeline = [], [], None
        for _ in range(repeats):
            stage.zero_grad(set_to_none=True)
            t0 = common_clock(pipe.device)
            _, events = pipe.scratch_step(stage, m, t0)
            all_events = [None] * pipe.world
            dist.all_gather_object(all_events, [vars(e) for e in events])
            seconds.append(max(e["end"] for ev in all_events for e in ev))
            bubbles.append(measured_bubble([[Event(**e) for e in ev] for ev in all_events]))
            timeline = all_events
        row = {"micro_batches": m, "measured_bubble": statistics.median(bubbles),
               "analytic_bubble": bubble_fraction(pipe.world, m), "step_seconds": statistics.median(seconds),
               "timeline": timeline}
        for name in SCHEDULES:
            if name == "Schedule1F1B" and m < pipe.world:  # 1F1B needs a micro-batch in flight per stage
                row[f"{name}_step_seconds"] = None
                continue
            lib_stage = pipe.fresh_stage()
            schedule = pipe.library_schedule(name, lib_stage, m)
            pipe.library_step(schedule, lib_stage)  # warm-up (and the schedule's shape exchange)
            times = []
            for _ in range(repeats):
                lib_stage.zero_grad(set_to_none=True)
                t0 = common_clock(pipe.device)
                pipe.library_step(schedule, lib_stage)
                synchronize(pipe.device)
                times.append(max_over_ranks(time.perf_counter() - t0, pipe.device))
            row[f"{name}_step_seconds"] = statistics.median(times)
        rows.append(row)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch", type=positive_int, default=8, help="sequences per global batch")
    parser.add_argument("--micro", type=positive_int, default=4, help="micro-batches in the equality checks")
    parser.add_argument("--bubble-micro", type=positive_int, nargs="*", default=[],
                        help="micro-batch counts of the bubble sweep (each must divide --batch); none: no sweep")
    parser.add_argument("--repeats", type=positive_int, default=3, help="timed steps per micro-batch count")
    args = parser.parse_args()
    for m in [args.micro, *args.bubble_micro]:
        if m < 1 or args.batch % m:
            parser.error(f"--batch {args.batch} cannot be cut into {m} equal micro-batches")

    runtime = setup(args.device, args.timeout)
    device = runtime.device
    config = config_from_args(args)
    if runtime.world_size > config.n_layers:
        raise SystemExit(f"{runtime.world_size} stages need at least as many layers; pass --layers "
                         f"{runtime.world_size} or more")
    torch.manual_seed(args.seed)
    base = GPT(config).to(device)
    x = torch.randint(config.vocab_size, (args.batch, config.context_length)).to(device)
    y = torch.randint(config.vocab_size, (args.batch, config.context_length)).to(device)
    reference = copy.deepcopy(base)
    ref_loss = lm_loss(reference(x), y)
    ref_loss.backward()
    ref_grads = {n: p.grad for n, p in reference.named_parameters()}

    pipe = Pipeline(base, runtime, x, y)
    params_per_rank = [None] * runtime.world_size
    dist.all_gather_object(params_per_rank, sum(p.numel() for p in pipe.fresh_stage().parameters()))
    activation_bytes = args.batch * config.context_length * config.d_model * 4
    tied_bytes = config.vocab_size * config.d_model * 4 if config.tie_weights and runtime.world_size > 1 else 0
    results = run_info(runtime, config, batch=args.batch, micro=args.micro, layers_per_stage=[
        len(layers) for layers in stage_layers(config.n_layers, runtime.world_size)],
        params_per_rank=params_per_rank,
        parameters=base.num_parameters(),
        # per stage boundary and step: every micro-batch's activations forward, their gradients back; and the
        # all-reduce of the tied embedding's gradient between the first and the last stage
        analytic_bytes={"activations_forward": activation_bytes, "gradients_backward": activation_bytes,
                        "tied_allreduce_per_rank": ring_all_reduce_bytes(tied_bytes, 2) if tied_bytes else 0})
    results.update(check_equal(pipe, args.micro, ref_grads, ref_loss.item()))
    if args.bubble_micro:
        results["bubble"] = bubble_sweep(pipe, args.bubble_micro, args.repeats)
    write_json(runtime, args.out, results)
    finish_and_exit()


if __name__ == "__main__":
    main()
