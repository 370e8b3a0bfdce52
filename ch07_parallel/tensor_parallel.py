"""Tensor parallelism: each rank holds a slice of every block's weights (its attention heads, its MLP units).

    python -m torch.distributed.run --standalone --nproc-per-node 2 ch07_parallel/tensor_parallel.py --out tp.json

Two versions of the same Megatron-style split of a `helpers.GPT`, both compared on rank 0's single-process model
(same weights, same batch): logits, loss and every parameter's gradient (each rank checks its own shard).

1. From scratch (`helpers.parallel.tensor_parallel`): column- and row-parallel linear layers with the f/g operators; the
   all-reduces are counted (calls and bytes, forward and backward) against the analytic count: per block one
   all-reduce of batch x seq x d_model activations in forward and one in backward, for attention and for the MLP.
   On gloo, the bytes each rank wrote to its sockets are compared with the ring all-reduce volume.
2. PyTorch's `torch.distributed.tensor.parallel` (`parallelize_module` with ColwiseParallel / RowwiseParallel on a
   DTensor device mesh); its collectives are counted with `CommDebugMode`.

Also: the parameters and bytes each rank holds, against DDP (which holds them all). Rank 0 writes JSON to --out.
"""

import argparse
import copy
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.debug import CommDebugMode

from helpers.model.gpt import GPT
from helpers.parallel.comm import bytes_written, ring_all_reduce_bytes
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
from helpers.parallel.tensor_parallel import TPLogs, parallelize_gpt, shard_of, tensor_parallel_gpt
from helpers.system.args import positive_int
from helpers.training.step import lm_loss


def reference_pass(base: GPT, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and gradients of one process running the whole model."""
    model = copy.deepcopy(base)
    logits = model(x)
    lm_loss(logits, y).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


def from_scratch(base: GPT, x, y, ref_logits, ref_grads, runtime) -> dict:
    rank, world, device = runtime.rank, runtime.world_size, runtime.device
    logs = TPLogs()
    model = tensor_parallel_gpt(base, rank, world, logs).to(device)
    dist.barrier()
    w0 = bytes_written()
    logits = model(x)
    w1 = bytes_written()
    loss = lm_loss(logits, y)
    loss.backward()
    w2 = bytes_written()
    gloo = runtime.backend == "gloo" and w0 is not None
    grad_diff = max(max_abs_diff(p.grad, shard_of(model, n, ref_grads[n].to(device)))
                    for n, p in model.named_parameters())
    return {
        "logits_max_diff": max_over_ranks(max_abs_diff(logits, ref_logits), device),
        "grad_max_diff": max_over_ranks(grad_diff, device),
        "forward_allreduces": logs.forward.calls, "forward_allreduce_bytes": logs.forward.bytes,
        "backward_allreduces": logs.backward.calls, "backward_allreduce_bytes": logs.backward.bytes,
        "forward_bytes_written": (w1 - w0) if gloo else None,
        "backward_bytes_written": (w2 - w1) if gloo else None,
        "params_per_rank": sum(p.numel() for p in model.parameters()),
        "block_params_per_rank": sum(p.numel() for p in model.blocks.parameters()),
    }


def with_dtensor(base: GPT, x, y, ref_logits, ref_grads, runtime) -> dict:
    device = runtime.device
    mesh = init_device_mesh(device.type, (runtime.world_size,))
    model = copy.deepcopy(base).to(device)
    permutations = parallelize_gpt(model, mesh)
    # CommDebugMode tracks modules from the forward on, so count a forward alone, then forward and backward.
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # CommDebugMode's module tracker
    forward_only, both = CommDebugMode(), CommDebugMode()
    with forward_only, torch.no_grad():
        model(x)
    with both:
        logits = model(x)
        lm_loss(logits, y).backward()
    forward_counts = {str(op): n for op, n in forward_only.get_comm_counts().items()}
    backward_counts = {str(op): n - forward_counts.get(str(op), 0) for op, n in both.get_comm_counts().items()}
    grad_diff = 0.0
    for name, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        expected = ref_grads[name].to(device)
        if name in permutations:
            expected = expected[permutations[name].to(device)]
        grad_diff = max(grad_diff, max_abs_diff(grad, expected))
    local = sum((p.to_local() if isinstance(p, DTensor) else p).numel() for p in model.parameters())
    return {
        "logits_max_diff": max_over_ranks(max_abs_diff(logits, ref_logits), device),
        "grad_max_diff": max_over_ranks(grad_diff, device),
        "forward_collectives": forward_counts,
        "backward_collectives": backward_counts,
        "params_per_rank": local,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_args(parser)
    parser.add_argument("--batch", type=positive_int, default=4)
    parser.add_argument("--seq", type=positive_int, help="tokens per sequence (default: the context length)")
    args = parser.parse_args()

    runtime = setup(args.device, args.timeout)
    device, world = runtime.device, runtime.world_size
    config = config_from_args(args)
    seq = args.seq or config.context_length
    torch.manual_seed(args.seed)
    base = GPT(config)  # identical on every rank: same seed
    x = torch.randint(config.vocab_size, (args.batch, seq)).to(device)
    y = torch.randint(config.vocab_size, (args.batch, seq)).to(device)
    ref_logits, ref_grads = reference_pass(base.to(device), x, y)  # every rank: each checks its own shard

    activation_bytes = args.batch * seq * config.d_model * 4  # one fp32 (batch, seq, d_model) tensor
    n_blocks = 2 * config.n_layers  # attention and MLP of every layer
    results = run_info(runtime, config, batch=args.batch, seq=seq, parameters=base.num_parameters(),
                       block_parameters=sum(p.numel() for p in base.blocks.parameters()),
                       analytic={"allreduces_per_pass": n_blocks, "bytes_per_allreduce": activation_bytes,
                                 "allreduce_bytes_per_pass": n_blocks * activation_bytes,
                                 "ring_bytes_sent_per_pass": ring_all_reduce_bytes(n_blocks * activation_bytes,
                                                                                   world)})
    results["from_scratch"] = from_scratch(base, x, y, ref_logits, ref_grads, runtime)
    results["dtensor"] = with_dtensor(base, x, y, ref_logits, ref_grads, runtime)
    write_json(runtime, args.out, results)
    finish_and_exit()


if __name__ == "__main__":
    main()
