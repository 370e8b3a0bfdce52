"""Run under torchrun by tests/test_forward_paths.py: every way of splitting the GPT across 2 ranks (tensor parallel
from scratch, with DTensor, pipeline stages), for each feed-forward and attention implementation, against the
single-process model's logits and gradients, in float64 (float32 for a kernel without float64). Rank 0 writes one
JSON row per combination to the path given first; the attention implementations to run follow it (default: all)."""

import copy
import json
import sys

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from helpers.model.attention import IMPLEMENTATIONS, AttentionCall, unavailable_reason
from helpers.model.config import GPTConfig
from helpers.model.feed_forward import FEED_FORWARDS
from helpers.model.gpt import GPT
from helpers.parallel.pipeline import (
    full_name,
    gpipe_step,
    is_first_stage,
    is_last_stage,
    pipeline_stage,
    sync_tied_gradients,
    tied_group,
)
from helpers.parallel.runtime import finish_and_exit, max_over_ranks, setup
from helpers.parallel.tensor_parallel import parallelize_gpt, shard_of, tensor_parallel_gpt
from helpers.training.step import lm_loss

CONFIG = GPTConfig(vocab_size=61, context_length=16, d_model=48, n_heads=4, n_layers=2, dropout=0.0)


def diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach() - b.detach()).abs().max().item()


def tensor_parallel(base, x, y, ref_logits, ref_grads, runtime) -> tuple[float, float]:
    model = tensor_parallel_gpt(base, runtime.rank, runtime.world_size)
    logits = model(x)
    lm_loss(logits, y).backward()
    grads = max(diff(p.grad, shard_of(model, n, ref_grads[n])) for n, p in model.named_parameters())
    return diff(logits, ref_logits), grads


def dtensor(base, x, y, ref_logits, ref_grads, runtime) -> tuple[float, float]:
    model = copy.deepcopy(base)
    permutations = parallelize_gpt(model, init_device_mesh("cpu", (runtime.world_size,)))
    logits = model(x)
    lm_loss(logits, y).backward()
    grads = 0.0
    for n, p in model.named_parameters():
        grad = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
        expected = ref_grads[n][permutations[n]] if n in permutations else ref_grads[n]
        grads = max(grads, diff(grad, expected))
    return diff(logits, ref_logits), grads


def pipeline(base, x, y, ref_logits, ref_grads, runtime, group) -> tuple[float, float]:
    stage = pipeline_stage(base, runtime.rank, runtime.world_size)
    shape = (x.size(0), x.size(1), CONFIG.d_model)
    losses, _ = gpipe_step(stage, x if is_first_stage(stage) else None, y if is_last_stage(stage) else None, 1,
                           lm_loss, shape, runtime.rank)
    sync_tied_gradients(stage, group)
    grads = max(diff(p.grad, ref_grads[full_name(stage, n)]) for n, p in stage.named_parameters())
    loss = abs(losses[0] - lm_loss(ref_logits, y).item()) if losses else 0.0
    return loss, grads


def reference(base, x, y) -> tuple[torch.Tensor, dict]:
    """The single-process model's logits and gradients, on a copy (`base` stays as it is for the split paths)."""
    model = copy.deepcopy(base)
    logits = model(x)
    lm_loss(logits, y).backward()
    return logits, {n: p.grad for n, p in model.named_parameters()}


def finish(rows: list[dict], runtime) -> None:
    """Rank 0 writes the rows to the path given first; every rank then exits."""
    if runtime.is_main:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f)
    finish_and_exit()


def main() -> None:
    runtime = setup("cpu", timeout_s=120)
    group = tied_group(runtime.world_size)
    generator = torch.Generator().manual_seed(0)
    x, y = (torch.randint(CONFIG.vocab_size, (3, CONFIG.context_length), generator=generator) for _ in range(2))
    rows = []
    for ffn in FEED_FORWARDS:
        for name in sys.argv[2:] or IMPLEMENTATIONS:
            f64 = unavailable_reason(name, AttentionCall("cpu", torch.float64)) is None
            dtype = torch.float64 if f64 else torch.float32
            torch.manual_seed(0)
            base = GPT(GPTConfig(**{**CONFIG.__dict__, "ffn_type": ffn}), attn_implementation=name).to(dtype)
            try:
                ref_logits, ref_grads = reference(base, x, y)
            except (RuntimeError, ValueError) as err:  # not available here at all (flash-attn, FlexAttention's
                for path in ("tensor_parallel", "dtensor", "pipeline"):  # backward on CPU)
                    rows.append({"path": path, "ffn": ffn, "impl": name, "status": "refused", "reason": str(err)})
                continue
            for path, run in (("tensor_parallel", tensor_parallel), ("dtensor", dtensor),
                              ("pipeline", lambda *a: pipeline(*a, group))):
                try:
                    first, grads = run(base, x, y, ref_logits, ref_grads, runtime)
                except (RuntimeError, ValueError) as err:
                    rows.append({"path": path, "ffn": ffn, "impl": name, "status": "refused", "reason": str(err)})
                    continue
                rows.append({"path": path, "ffn": ffn, "impl": name, "status": "ok", "dtype": str(dtype),
                             "output_diff": max_over_ranks(first, runtime.device),
                             "grad_diff": max_over_ranks(grads, runtime.device)})
    finish(rows, runtime)


if __name__ == "__main__":
    main()
