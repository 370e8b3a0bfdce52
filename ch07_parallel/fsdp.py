"""Fully sharded data parallelism (FSDP2, `torch.distributed.fsdp.fully_shard`) against DDP on the same training.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ch07_parallel/fsdp.py --strategy fsdp --out f.json

Like DDP, every rank trains on its own part of each batch. Unlike DDP, no rank keeps the whole model: each
holds 1/p of every parameter, gradient and optimizer state (ZeRO-3). Before a block runs, its parameters are
all-gathered; after its backward, the gradients are reduce-scattered, so each rank keeps only its shard's sum.

`--strategy fsdp` shards each transformer block and then the whole model (embeddings, final LayerNorm, tied LM
head); `--strategy ddp` replicates the model. Both train the GPT for --steps AdamW steps and report:

* the largest difference from one process trained on the concatenated batches (rank 0; --no-check skips it);
* the training state each rank holds (parameters, gradients, AdamW moments; bytes of the local tensors);
* the peak memory of the training steps: CUDA's max_memory_allocated, or on CPU the peak resident set above the
  process before the model was built (exact when the launcher sets MEMORY_ENV, as the notebook does);
* the bytes each rank sent per step (gloo on Linux) against the analytic volume of the collectives.

Run each strategy in its own launch, so one does not inherit the other's memory. Rank 0 writes JSON to --out.
"""

import argparse
import copy
import gc
import statistics
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from helpers.measure.memory import peak_cuda_bytes, peak_rss_above_baseline, proc_status_bytes
from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.parallel.comm import bytes_written, ring_all_reduce_bytes, tensor_bytes
from helpers.parallel.runtime import (
    add_common_args,
    add_dtype_arg,
    config_from_args,
    finish_and_exit,
    max_abs_diff,
    rank_batches,
    run_info,
    setup,
    token_ids,
    write_json,
)
from helpers.system.args import positive_float, positive_int
from helpers.system.device import parse_dtype, synchronize
from helpers.text.data import NextTokenDataset
from helpers.training.step import lm_loss


def local_bytes(t: torch.Tensor | None) -> int:
    """Bytes this rank stores for `t`: its shard when `t` is a DTensor."""
    if t is None:
        return 0
    return tensor_bytes(t.to_local() if isinstance(t, DTensor) else t)


def build(strategy: str, config, seed: int, runtime, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = GPT(config).to(dtype)
    device = runtime.device
    if strategy == "ddp":
        return DDP(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    mesh = init_device_mesh(device.type, (runtime.world_size,))
    for block in model.blocks:  # one all-gather / reduce-scatter unit per block ...
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # ... and one for the rest: embeddings, tied LM head, final LayerNorm
    return model


def warm_up(strategy: str, runtime) -> None:
    """One step of a tiny model through the same code path, so libraries' first-use allocations (kernels, thread
    pools, communication buffers) happen before the memory baseline is taken."""
    tiny = GPTConfig(vocab_size=64, context_length=8, d_model=32, n_heads=2, n_layers=1, dropout=0.0)
    model = build(strategy, tiny, 0, runtime)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(64, (2, 8), device=runtime.device)
    lm_loss(model(x), x).backward()
    opt.step()
    del model, opt
    gc.collect()


def training_peak_bytes(train: Callable[[], None], device: torch.device, model_rss: int | None) -> tuple[int, str]:
    """The peak memory of the training steps, the model they train included, each byte counted once; and its kind.

    CUDA: what `train()` adds at its peak above what was allocated just before it (the model), plus that. The
    optimizer state the first step creates is in the peak already: adding what is allocated *after* the steps
    would count it twice. CPU: the peak RSS above the process just before `train()`, plus what building the model
    added (`model_rss`).
    """
    if device.type == "cuda":
        before = torch.cuda.memory_allocated(device)
        return peak_cuda_bytes(train, device) + before, "cuda max_memory_allocated"
    return peak_rss_above_baseline(train) + (model_rss or 0), "peak RSS above the process before the model was built"


def collective_bytes(runtime, numel: int) -> dict:
    """Bytes this rank writes for one reduce-scatter and one all-gather of `numel` fp32 values (gloo on Linux):
    what the backend really sends, against the ring's (p-1)/p."""
    world, device = runtime.world_size, runtime.device
    numel -= numel % world
    full, shard = torch.ones(numel, device=device), torch.ones(numel // world, device=device)
    # torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor to *_single; older releases have only those
    reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    sent = {}
    for name, call in (("reduce_scatter", lambda: reduce_scatter(shard, full)),
                       ("all_gather", lambda: all_gather(full, shard))):
        dist.barrier()
        w0 = bytes_written()
        call()
        w1 = bytes_written()
        sent[name] = None if w0 is None or runtime.backend != "gloo" else w1 - w0
    return {"full_bytes": numel * 4, "ring_bytes": (world - 1) / world * numel * 4, "sent": sent}


def analytic_bytes(strategy: str, base: GPT, world: int) -> dict:
    """Bytes each rank sends per step. DDP: a ring all-reduce of the gradients. FSDP: an all-gather of each block
    in forward and again in backward (the block was resharded after its forward), one of the root group (kept
    until backward), and a reduce-scatter of all gradients; a ring all-gather or reduce-scatter sends (p-1)/p."""
    total = sum(tensor_bytes(p) for p in base.parameters())
    if strategy == "ddp":
        return {"allreduce": ring_all_reduce_bytes(total, world)}
    blocks = sum(tensor_bytes(p) for p in base.blocks.parameters())
    share = (world - 1) / world
    return {"all_gather_forward": share * total, "all_gather_backward": share * blocks,
            "reduce_scatter": share * total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_dtype_arg(parser)
    parser.add_argument("--strategy", choices=["fsdp", "ddp"], default="fsdp")
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences per rank per step")
    parser.add_argument("--steps", type=positive_int, default=3)
    parser.add_argument("--lr", type=positive_float, default=1e-3)
    parser.add_argument("--no-check", action="store_true", help="skip the single-process reference")
    args = parser.parse_args()

    runtime = setup(args.device, args.timeout)
    rank, world, device = runtime.rank, runtime.world_size, runtime.device
    config = config_from_args(args)
    dataset = NextTokenDataset(token_ids(config.vocab_size), config.context_length)
    all_batches = [rank_batches(dataset, world, r, args.batch, args.seed, args.steps) for r in range(world)]
    batches = [(x.to(device), y.to(device)) for x, y in all_batches[rank]]

    warm_up(args.strategy, runtime)
    gc.collect()
    rss_before = proc_status_bytes("VmRSS")
    dtype = parse_dtype(args.dtype)
    model = build(args.strategy, config, args.seed, runtime, dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)
    gc.collect()
    model_rss = None if rss_before is None else proc_status_bytes("VmRSS") - rss_before
    state, written = {}, []

    def train() -> None:
        for step, (x, y) in enumerate(batches):
            dist.barrier()
            w0 = bytes_written()
            lm_loss(model(x), y).backward()
            if step == len(batches) - 1:
                state["gradients"] = sum(local_bytes(p.grad) for p in model.parameters())
            opt.step()
            opt.zero_grad(set_to_none=True)
            synchronize(device)
            w1 = bytes_written()
            written.append(None if w0 is None or runtime.backend != "gloo" else w1 - w0)

    peak, peak_kind = training_peak_bytes(train, device, model_rss)
    state["parameters"] = sum(local_bytes(p) for p in model.parameters())
    state["optimizer"] = sum(local_bytes(v) for s in opt.state.values() for v in s.values() if torch.is_tensor(v))

    torch.manual_seed(args.seed)
    base = GPT(config).to(dtype)  # the initial weights again (built after the measurement: not counted in it)
    results = run_info(runtime, config, dtype=args.dtype, strategy=args.strategy, batch_per_rank=args.batch,
                       steps=args.steps,
                       parameters=base.num_parameters(),
                       parameter_bytes=sum(tensor_bytes(p) for p in base.parameters()),
                       analytic_bytes_per_step=analytic_bytes(args.strategy, base, world))
    results["collective_probe"] = collective_bytes(runtime, base.num_parameters())
    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"state_bytes": state, "peak_bytes": peak,
                                      "bytes_written_per_step": written[1:] or written})
    results.update(per_rank=per_rank, peak_kind=peak_kind,
                   bytes_written_median=[None if r["bytes_written_per_step"][0] is None
                                         else statistics.median(r["bytes_written_per_step"]) for r in per_rank])

    if not args.no_check:
        trained = model.module if args.strategy == "ddp" else model
        # full_tensor() all-gathers each sharded parameter: a collective, so every rank takes part.
        full = {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach()
                for n, p in trained.named_parameters()}
        if runtime.is_main:
            reference = copy.deepcopy(base).to(device)
            ref_opt = torch.optim.AdamW(reference.parameters(), lr=args.lr, weight_decay=0.1)
            for s in range(args.steps):
                x = torch.cat([all_batches[r][s][0] for r in range(world)]).to(device)
                y = torch.cat([all_batches[r][s][1] for r in range(world)]).to(device)
                lm_loss(reference(x), y).backward()
                ref_opt.step()
                ref_opt.zero_grad(set_to_none=True)
            results["max_param_diff"] = max(max_abs_diff(full[n], p) for n, p in reference.named_parameters())
            results["max_param_change"] = max(max_abs_diff(p, q) for p, q in
                                              zip(reference.parameters(), base.parameters(), strict=True))
    write_json(runtime, args.out, results)
    finish_and_exit()


if __name__ == "__main__":
    main()
