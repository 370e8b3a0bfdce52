"""Expert parallelism: each rank holds n_experts / world of every MoE layer's experts, and the tokens travel to them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 ch07_parallel/expert_parallel.py --out ep.json

The GPT with Mixture-of-Experts feed-forwards (`--ffn moe`, the default here) is split with
`helpers.parallel.expert_parallel`: outside the experts every rank holds the whole model and runs its own part of the
batch (data parallel); in each MoE layer the token slots go to the rank that owns their expert and their outputs
come back, with `all_to_all_single` (the counts first, then the hidden vectors). Compared with one process running
the whole batch (same weights, computed on every rank): each rank's logits, the loss (the token loss plus the
routers' balance and z-losses, `RouterLoss`), and every gradient (each rank its own experts; the replicated
parameters' gradients averaged over the ranks, as DDP would).

The exchanges are counted (calls, bytes handed, bytes sent to other ranks, forward and backward apart) against the
analytic figure for the routing one process chose (`exchange_bytes`: the slots each rank sends away and gets back),
and, on gloo, against the bytes each rank wrote to its sockets. float64 by default, so that both routes choose the
same experts and the comparison is exact. Rank 0 writes JSON to --out.
"""

import argparse
import copy
import dataclasses

import torch
import torch.distributed as dist

from helpers.model.gpt import GPT
from helpers.model.moe import moe_layers
from helpers.parallel.comm import bytes_written
from helpers.parallel.expert_parallel import (
    EPLogs,
    average_gradients,
    exchange_bytes,
    expert_parallel_gpt,
    experts_owned,
    shard_of,
)
from helpers.parallel.runtime import (
    add_common_args,
    add_dtype_arg,
    config_from_args,
    finish_and_exit,
    max_abs_diff,
    max_over_ranks,
    run_info,
    setup,
    write_json,
)
from helpers.system.args import positive_int
from helpers.system.device import parse_dtype
from helpers.training.step import RouterLoss, lm_loss

ROUTER = RouterLoss(balance=0.01, z=0.001)


def mean_loss(model: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The logits, and the loss per target token with the routers' balance and z terms (`RouterLoss`)."""
    logits = model(x)
    return logits, lm_loss(logits, y) + ROUTER.router_terms(model)


def reference_pass(base: GPT, x: torch.Tensor, y: torch.Tensor):
    """One process on the whole batch: logits, loss, gradients, and each MoE layer's chosen experts (tokens, k)."""
    model = copy.deepcopy(base)
    logits, loss = mean_loss(model, x, y)
    loss.backward()
    experts = [layer.routing.experts for layer in moe_layers(model)]
    return logits.detach(), loss.item(), {n: p.grad for n, p in model.named_parameters()}, experts


def analytic_bytes(experts: list[torch.Tensor], world: int, config, element_size: int) -> list[dict[str, int]]:
    """Per rank, bytes sent to other ranks per forward and per backward pass, summed over the MoE layers: rank r's
    tokens are its rows of the batch, so its slots are its rows of each layer's (tokens, k) routing."""
    total = [{"forward": 0, "backward": 0} for _ in range(world)]
    for layer in experts:
        per_rank = exchange_bytes(layer.chunk(world), config.n_experts, config.d_model * element_size)
        for rank_total, layer_bytes in zip(total, per_rank, strict=True):
            for phase in rank_total:
                rank_total[phase] += layer_bytes[phase]
    return total


def expert_parallel_pass(base: GPT, x, y, reference, runtime) -> dict:
    ref_logits, ref_loss, ref_grads, _ = reference
    rank, world = runtime.rank, runtime.world_size
    mine = slice(rank * len(x) // world, (rank + 1) * len(x) // world)  # this rank's part of the batch
    logs = EPLogs()
    model = expert_parallel_gpt(base, rank, world, logs)
    dist.barrier()
    w0 = bytes_written()
    logits, loss = mean_loss(model, x[mine], y[mine])
    w1 = bytes_written()
    loss.backward()
    w2 = bytes_written()
    average_gradients(model)
    loss_mean = torch.tensor([loss.item() / world], dtype=torch.float64)
    dist.all_reduce(loss_mean)
    grad_diff = max(max_abs_diff(p.grad, shard_of(model, n, ref_grads[n])) for n, p in model.named_parameters())
    gloo = runtime.backend == "gloo" and w0 is not None
    own = {"rank": rank, "experts": list(experts_owned(base.config.n_experts, rank, world)),
           "params": sum(p.numel() for p in model.parameters()),
           "forward_bytes_written": (w1 - w0) if gloo else None,
           "backward_bytes_written": (w2 - w1) if gloo else None,
           **{f"{phase}_{what}": getattr(getattr(logs, phase), what)
              for phase in ("forward", "backward") for what in ("calls", "bytes", "bytes_sent")}}
    per_rank = [None] * world
    dist.all_gather_object(per_rank, own)
    return {"logits_max_diff": max_over_ranks(max_abs_diff(logits, ref_logits[mine]), runtime.device),
            "grad_max_diff": max_over_ranks(grad_diff, runtime.device),
            "loss_diff": abs(loss_mean.item() - ref_loss),
            "per_rank": per_rank}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    add_dtype_arg(parser)
    parser.add_argument("--batch", type=positive_int, default=4, help="sequences in the whole batch (all ranks)")
    parser.add_argument("--seq", type=positive_int, help="tokens per sequence (default: the context length)")
    parser.add_argument("--experts", type=positive_int, help="n_experts (default: GPTConfig's)")
    parser.add_argument("--top-k", type=positive_int, help="experts_per_token (default: GPTConfig's)")
    parser.add_argument("--shared-expert", action="store_true", help="one more, replicated expert every token runs")
    parser.set_defaults(ffn="moe", dtype="float64")
    args = parser.parse_args()
    if args.ffn != "moe":
        parser.error(f"expert parallelism splits Mixture-of-Experts layers: --ffn moe, not {args.ffn}")
    try:
        config = config_from_args(args)
        overrides = {"n_experts": args.experts, "experts_per_token": args.top_k, "shared_expert": args.shared_expert}
        config = dataclasses.replace(config, **{k: v for k, v in overrides.items() if v is not None})
    except ValueError as err:
        parser.error(str(err))

    runtime = setup(args.device, args.timeout)
    world = runtime.world_size
    if args.batch % world:
        parser.error(f"--batch {args.batch} cannot be shared equally by {world} ranks")
    if config.n_experts % world:
        parser.error(f"{config.n_experts} experts cannot be shared equally by {world} ranks (--experts)")
    dtype = parse_dtype(args.dtype)
    seq = args.seq or config.context_length
    torch.manual_seed(args.seed)
    base = GPT(config).to(device=runtime.device, dtype=dtype)  # identical on every rank: same seed
    x = torch.randint(config.vocab_size, (args.batch, seq)).to(runtime.device)
    y = torch.randint(config.vocab_size, (args.batch, seq)).to(runtime.device)
    reference = reference_pass(base, x, y)  # every rank: each checks its own part
    element_size = torch.empty((), dtype=dtype).element_size()
    results = run_info(runtime, config, batch=args.batch, seq=seq, dtype=args.dtype,
                       parameters=base.num_parameters(),
                       analytic_bytes_per_rank=analytic_bytes(reference[3], world, config, element_size))
    results["expert_parallel"] = expert_parallel_pass(base, x, y, reference, runtime)
    write_json(runtime, args.out, results)
    finish_and_exit()


if __name__ == "__main__":
    main()
