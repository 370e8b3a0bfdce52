"""bench-decode: the bytes a decode step must read (tied weights once, the cache per sequence) and the MBU derived
from them, against hand counts; the command line's checks. Timings are not asserted."""

import json

import pytest
import torch

from helpers import GPT, GPTConfig
from helpers.__main__ import main
from helpers.inference.kv_cache import kv_cache_bytes_per_token
from helpers.inference.kv_quant import kv_bytes_per_token_int8
from helpers.inference.quantization import Int8Linear, quantize_linears
from helpers.measure import calibration, decode_bench
from helpers.measure.decode_bench import SETUPS, bench_decode, weight_bytes
from helpers.measure.timing import Spread

CONFIG = GPTConfig(vocab_size=300, context_length=32, d_model=32, n_heads=2, n_layers=2, dropout=0.0)


def fake_calibration():
    return calibration.Calibration("cpu", "Test CPU", torch.__version__, torch.get_num_threads(),
                                   {"L2": 1 << 20, "L3": 32 << 20}, {"L2": 1 << 19, "L3": 16 << 20, "DRAM": 1 << 28},
                                   bandwidths={"L2": Spread((90e9,)), "L3": Spread((50e9,)),
                                               "DRAM": Spread((20e9,))})


def test_weight_bytes_count_a_tied_matrix_once():
    torch.manual_seed(0)
    model = GPT(CONFIG)
    assert model.lm_head.weight is model.tok_emb.weight
    by_hand = sum(p.numel() * p.element_size() for p in model.parameters())  # parameters() yields a shared one once
    assert weight_bytes(model) == by_hand
    int8 = quantize_linears(GPT(CONFIG), "weight_only", skip=("lm_head",))
    linear = sum(m.weight.numel() for n, m in GPT(CONFIG).named_modules()
                 if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert by_hand - weight_bytes(int8) >= 3 * linear - 4 * 4 * CONFIG.d_model * 12  # 1 byte a weight, plus scales


def test_bytes_per_step_and_mbu_follow_from_the_cache_and_the_weights():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    eager = tuple(s for s in SETUPS if not s.startswith("compiled"))  # compiled: in the compile test below
    results = bench_decode(model, [1, 3], 20, fake_calibration(), eager, rounds=1)
    assert [(r.setup, r.batch) for r in results] == [(s, b) for b in (1, 3) for s in eager]
    for r in results:
        kv = {"no cache": 0, "int8 KV": kv_bytes_per_token_int8(CONFIG)}.get(r.setup,
                                                                             kv_cache_bytes_per_token(CONFIG))
        weights = weight_bytes(model)
        if r.setup == "int8 weights":
            assert r.bytes_per_step - r.batch * 20 * kv < weights
        else:
            assert r.bytes_per_step == weights + r.batch * 20 * kv
        assert r.level == "L2" and r.bandwidth == 90e9  # a small model's bytes fit L2, the fastest level here
        assert r.mbu == pytest.approx(r.bytes_per_step / r.step.median / 90e9)
        assert r.tokens_per_s == pytest.approx(r.batch / r.step.median)
    with pytest.raises(ValueError, match="positions must be between 1 and 31"):
        bench_decode(model, [1], 32, fake_calibration())
    with pytest.raises(ValueError, match="unknown setups"):
        bench_decode(model, [1], 4, fake_calibration(), setups=("paged",))


def test_bench_decode_cli(capsys, monkeypatch):
    monkeypatch.setattr(calibration, "load_calibration", lambda *a, **k: fake_calibration())
    main(["bench-decode", "--model", "gpt-smoke", "--batch", "2", "--positions", "8", "--rounds", "1",
          "--setups", "cache", "int8 KV", "--device", "cpu", "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert [(r["setup"], r["batch"], r["positions"]) for r in rows] == [("cache", 2, 8), ("int8 KV", 2, 8)]
    assert rows[0]["bytes_per_step"] > rows[1]["bytes_per_step"]  # the int8 cache is smaller to read
    with pytest.raises(SystemExit) as exit_:
        main(["bench-decode", "--model", "gpt-smoke", "--positions", "64", "--device", "cpu"])
    assert exit_.value.code == 2 and "pass 63 or less" in capsys.readouterr().err


def test_int8_weights_are_benchmarked_on_any_device(monkeypatch):
    """Weight-only int8 is a cast and a scale, no CPU-only kernel: the setup runs where the model is (meta stands in
    for a GPU here; the steps are built but not timed)."""
    monkeypatch.setattr(decode_bench, "_decode_step", lambda *args: lambda: None)
    monkeypatch.setattr(decode_bench, "interleaved", lambda steps, device, rounds: {k: Spread((1e-3,)) for k in steps})
    model = GPT(CONFIG).to("meta")
    results = {r.setup: r for r in bench_decode(model, [1], 8, fake_calibration(), ("cache", "int8 weights"))}
    assert results["int8 weights"].bytes_per_step < results["cache"].bytes_per_step / 2
    layer = Int8Linear.from_linear(torch.nn.Linear(8, 4)).to("meta")  # its forward: a cast, a matmul, a scale
    assert layer(torch.zeros(2, 8, device="meta")).shape == (2, 4)


@pytest.mark.compile
def test_compiled_steps_read_the_eager_steps_bytes_or_the_int8_weights():
    """The compiled step (compiled once, before timing) needs the bytes of the eager cached step, over an int8 cache
    the int8 cache's; the compiled int8 step 1 byte per Linear weight (the LM head and the embedding it shares
    included) plus a float32 scale per output channel, the other parameters (norms, biases, position embeddings) in
    float32."""
    torch.compiler.reset()
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    results = {r.setup: r for r in bench_decode(model, [2], 20, fake_calibration(),
                                                ("cache", "compiled", "compiled int8", "compiled int8 KV"),
                                                rounds=1, backend="eager")}  # the bytes do not depend on it
    kv = 2 * 20 * kv_cache_bytes_per_token(CONFIG)
    assert results["compiled"].bytes_per_step == results["cache"].bytes_per_step == weight_bytes(model) + kv
    assert results["compiled int8 KV"].bytes_per_step == weight_bytes(model) + 2 * 20 * kv_bytes_per_token_int8(CONFIG)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    in_linears = {id(m.weight) for m in linears} | {id(m.bias) for m in linears if m.bias is not None}
    int8 = sum(m.weight.numel() + 4 * m.out_features for m in linears)
    floats = sum(4 * p.numel() for p in model.parameters() if id(p) not in in_linears)
    biases = sum(4 * m.bias.numel() for m in linears if m.bias is not None)
    assert results["compiled int8"].bytes_per_step == int8 + floats + biases + kv
