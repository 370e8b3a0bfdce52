"""One model, one forward pass: every path that runs the GPT (KV cache, paged serving engine, tensor parallel from
scratch and with DTensor, pipeline stages) runs the model's own forward, so it honours `attn_implementation` and
`ffn_type`. Each path, for each feed-forward and each attention implementation that supports it, against
`GPT.forward` in float64 (float32 for a kernel without float64); the others are refused with the reason.

Every tier runs one kernel of each family (projections written out by hand, a kernel that takes a mask, one that
does not, one refused on CPU); the other kernels are marked `slow`, which `make test` runs too."""

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.inference.kv_cache import KVCache, generate_with_cache
from helpers.inference.serving import Request, serve
from helpers.model.attention import IMPLEMENTATIONS, AttentionCall, unavailable_reason
from helpers.model.feed_forward import FEED_FORWARDS

CONFIG = GPTConfig(vocab_size=61, context_length=16, d_model=48, n_heads=4, n_layers=2, dropout=0.0)
FFNS = tuple(FEED_FORWARDS)  # every registered feed-forward type
TOLERANCE = {"torch.float64": 1e-10, "torch.float32": 1e-5}
REPRESENTATIVES = ("stacked", "sdpa", "flash_torch", "flex_attention")
KERNELS = [pytest.param(name, marks=() if name in REPRESENTATIVES else pytest.mark.slow) for name in IMPLEMENTATIONS]


def dtype_for(name: str) -> torch.dtype:
    return torch.float64 if unavailable_reason(name, AttentionCall("cpu", torch.float64)) is None else torch.float32


def model_for(ffn: str, name: str) -> GPT:
    torch.manual_seed(0)
    return GPT(dataclasses.replace(CONFIG, ffn_type=ffn), attn_implementation=name).to(dtype_for(name)).eval()


def forward_reason(name: str) -> str | None:
    return unavailable_reason(name, AttentionCall("cpu", dtype_for(name)))


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("ffn", FFNS)
def test_kv_cache_path(ffn, name):
    if forward_reason(name) is not None:
        pytest.skip(forward_reason(name))
    model = model_for(ffn, name)
    idx = torch.randint(CONFIG.vocab_size, (2, 11), generator=torch.Generator().manual_seed(1))
    cache = KVCache(CONFIG, batch=2, max_len=11, dtype=dtype_for(name))
    reason = unavailable_reason(name, AttentionCall("cpu", dtype_for(name), cached=True))
    if reason is not None:
        with pytest.raises(RuntimeError, match="a KV cache needs new queries against every cached key"):
            model(idx, cache=cache)
        return
    with torch.no_grad():
        pieces = [model(idx[:, :4], cache=cache), model(idx[:, 4:7], cache=cache),
                  *(model(idx[:, i : i + 1], cache=cache) for i in range(7, 11))]  # prefill, a chunk, decode
        expected = model(idx)
    tol = TOLERANCE[str(dtype_for(name))]
    torch.testing.assert_close(torch.cat(pieces, dim=1), expected, rtol=tol, atol=tol)
    assert torch.equal(generate_with_cache(model, idx[:, :5], 6), model.generate(idx[:, :5], 6))


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("ffn", FFNS)
def test_paged_engine_path(ffn, name):
    if forward_reason(name) is not None:
        pytest.skip(forward_reason(name))
    model = model_for(ffn, name)
    generator = torch.Generator().manual_seed(2)
    requests = [Request(i, tuple(torch.randint(CONFIG.vocab_size, (n,), generator=generator).tolist()), 5)
                for i, n in enumerate((1, 7, 3, 9))]
    engine_args = dict(max_batch=3, block_size=4, max_step_tokens=8)  # chunked prefill and batched decode
    if unavailable_reason(name, AttentionCall("cpu", dtype_for(name), cached=True)) is not None:
        with pytest.raises(RuntimeError, match="a KV cache needs new queries against every cached key"):
            serve(model, requests, **engine_args)
        return
    run = serve(model, requests, **engine_args)
    for request, completion in zip(requests, run.completions, strict=True):
        expected = model.generate(torch.tensor([request.prompt]), request.max_tokens)[0, len(request.prompt) :]
        assert completion.tokens == expected.tolist(), request.request_id


@pytest.fixture(scope="module")
def distributed_paths(request, torchrun, tmp_path_factory):
    """One torchrun launch for the kernels of the selected tests (the representatives, or all of them)."""
    names = sorted({item.callspec.params["name"] for item in request.session.items
                    if item.originalname == "test_distributed_path"})
    out = tmp_path_factory.mktemp("paths") / "rows.json"
    env = {"TRITON_INTERPRET": "1"} if "flash_triton" in names and not torch.cuda.is_available() else None
    torchrun(Path(__file__).with_name("distributed_paths.py"), [out, *names], nproc=2, timeout=600, env=env)
    return {(r["path"], r["ffn"], r["impl"]): r for r in json.loads(out.read_text())}


@pytest.mark.parametrize("name", KERNELS)
@pytest.mark.parametrize("ffn", FFNS)
@pytest.mark.parametrize("path", ["tensor_parallel", "dtensor", "pipeline"])
def test_distributed_path(distributed_paths, path, ffn, name):
    row = distributed_paths[path, ffn, name]
    dtype = dtype_for(name)
    # these paths train: forward and backward
    reason = unavailable_reason(name, AttentionCall("cpu", dtype, backward=True))
    sharded = unavailable_reason(name, AttentionCall("cpu", dtype, sharded=True))
    if reason is not None:
        assert row["status"] == "refused" and "cannot run here" in row["reason"], row
    elif path != "pipeline" and sharded is not None:
        assert row["status"] == "refused" and sharded in row["reason"], row
    else:
        assert row["status"] == "ok", row
        tol = TOLERANCE[row["dtype"]]
        assert row["output_diff"] < tol and row["grad_diff"] < tol, row
