"""The Mixture-of-Experts feed-forward against references written out token by token in float64: the routing (both
orders, the balancing bias, capacity), the layer with each dispatch, the balancing losses, DeepSeek-V3's bias
update, the FLOPs (active, not total), and training through the Trainer's loss."""

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from helpers.inference.compiled_decode import CompiledDecoder
from helpers.measure.flops import count_with_flop_counter, forward_flops
from helpers.measure.roofline import gpt_operations
from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.model.hf_files import WeightsError
from helpers.model.hf_llama import load_hf_llama, save_hf_llama
from helpers.model.moe import MoEFeedForward, active_parameters, moe_layers, route, update_router_bias
from helpers.training.step import FULL, RouterLoss, TrainingStep

CONFIG = GPTConfig(vocab_size=61, context_length=16, d_model=32, n_heads=4, n_layers=2, dropout=0.0, ffn_type="moe",
                   n_experts=4, experts_per_token=2, ffn_hidden=24)


def layer64(**changes) -> MoEFeedForward:
    torch.manual_seed(0)
    return MoEFeedForward(dataclasses.replace(CONFIG, **changes)).double()


def reference(layer: MoEFeedForward, x: torch.Tensor, capacity: int | None = None) -> torch.Tensor:
    """Token by token: softmax over the router's logits, the top k by probability plus bias, weighted as the order
    says, an expert skipped once it has served `capacity` slots; each expert a SwiGLU written out."""
    out = torch.zeros_like(x)
    served = [0] * layer.gate_up.size(0)
    for t in range(x.size(0)):
        logits = x[t] @ layer.router.weight.T
        probs = torch.softmax(logits, -1)
        chosen = torch.argsort(probs + layer.router_bias, descending=True)[: layer.k]
        weights = probs[chosen] / (probs[chosen].sum() if layer.order == "topk_softmax" else 1)
        for e, w in zip(chosen.tolist(), weights, strict=True):
            served[e] += 1
            if capacity is not None and served[e] > capacity:
                continue
            gate, up = (x[t] @ layer.gate_up[e].T).chunk(2)
            out[t] += w * ((F.silu(gate) * up) @ layer.down[e].T)
    if layer.shared is not None:
        out += layer.shared(x)
    return out


@pytest.mark.parametrize("order", ["softmax_topk", "topk_softmax"])
@pytest.mark.parametrize("dispatch", ["loop", "sorted", "gather"])
@pytest.mark.parametrize("shared", [False, True])
def test_the_layer_is_the_weighted_sum_of_its_chosen_experts(order, dispatch, shared):
    layer = layer64(moe_router=order, shared_expert=shared)
    layer.dispatch = dispatch
    with torch.no_grad():
        layer.router_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1], dtype=torch.float64))
    x = torch.randn(2, 7, CONFIG.d_model, dtype=torch.float64)
    torch.testing.assert_close(layer(x).flatten(0, 1), reference(layer, x.flatten(0, 1)), rtol=0, atol=1e-12)


def test_top_k_then_softmax_is_softmax_then_top_k_renormalised():
    logits = torch.randn(50, 8, dtype=torch.float64)
    plain, mixtral = route(logits, 3, "softmax_topk"), route(logits, 3, "topk_softmax")
    assert torch.equal(plain.experts, mixtral.experts)
    torch.testing.assert_close(mixtral.weights, plain.weights / plain.weights.sum(-1, keepdim=True), rtol=0,
                               atol=1e-15)
    assert torch.all(plain.weights.sum(-1) < 1)


def test_the_bias_chooses_experts_but_does_not_weight_them():
    logits = torch.randn(40, 4, dtype=torch.float64)
    bias = torch.tensor([10.0, 0.0, 0.0, 0.0], dtype=torch.float64)  # expert 0 is always chosen
    routing = route(logits, 2, "softmax_topk", bias)
    assert torch.all((routing.experts == 0).any(-1))
    torch.testing.assert_close(routing.weights, torch.softmax(logits, -1).gather(-1, routing.experts))


@pytest.mark.parametrize("dispatch", ["loop", "sorted", "gather"])
def test_capacity_keeps_each_experts_first_slots_and_counts_the_dropped(dispatch):
    layer = layer64(capacity_factor=0.5)
    layer.dispatch = dispatch
    x = torch.randn(12, CONFIG.d_model, dtype=torch.float64)
    capacity = math.ceil(0.5 * 12 * 2 / 4)
    routing = route(layer.router(x), 2, "softmax_topk", layer.router_bias, 0.5)
    kept_per_expert = torch.bincount(routing.experts[routing.kept], minlength=4)
    assert kept_per_expert.max() <= capacity
    assert routing.dropped == int((routing.load - capacity).clamp(min=0).sum()) > 0
    torch.testing.assert_close(layer(x[None])[0], reference(layer, x, capacity), rtol=0, atol=1e-12)


def test_every_dispatch_gives_the_same_gradients():
    x = torch.randn(3, 9, CONFIG.d_model, dtype=torch.float64)
    grads = {}
    for dispatch in ("loop", "sorted", "gather"):
        layer = layer64(shared_expert=True)
        layer.dispatch = dispatch
        layer(x).square().sum().backward()
        grads[dispatch] = [p.grad for p in layer.parameters()]
    for other in ("sorted", "gather"):
        for a, b in zip(grads["loop"], grads[other], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_the_grouped_product_gives_the_loop_in_float32():
    layer = layer64().float()
    x = torch.randn(4, 16, CONFIG.d_model)
    with torch.no_grad():
        loop = layer(x)
        layer.dispatch = "sorted"
        torch.testing.assert_close(layer(x), loop, rtol=1e-5, atol=1e-6)


def test_the_balancing_losses_against_their_formulas():
    logits = torch.randn(64, 4, dtype=torch.float64)
    routing = route(logits, 2, "softmax_topk")
    probs = torch.softmax(logits, -1)
    share = torch.stack([(routing.experts == e).sum() for e in range(4)]).double() / (64 * 2)
    assert routing.balance_loss().item() == pytest.approx(4 * float((share * probs.mean(0)).sum()), abs=1e-14)
    assert routing.z_loss().item() == pytest.approx(float(torch.logsumexp(logits, -1).pow(2).mean()), abs=1e-12)
    uniform = route(torch.zeros(8, 4, dtype=torch.float64) + torch.eye(4, dtype=torch.float64).repeat(2, 1) * 1e-9,
                    1, "softmax_topk")
    assert uniform.balance_loss().item() == pytest.approx(1.0, abs=1e-6)  # every expert 1/4 of slots and probability
    collapsed = route(torch.tensor([[50.0, 0, 0, 0]], dtype=torch.float64).repeat(8, 1), 1, "softmax_topk")
    assert collapsed.balance_loss().item() == pytest.approx(4.0, abs=1e-6)  # one expert takes everything


def test_the_bias_update_moves_tokens_toward_the_idle_experts():
    layer = layer64().train()
    x = torch.randn(256, CONFIG.d_model, dtype=torch.float64) + 0.5
    with torch.no_grad():
        layer.router.weight[0] += 0.1  # expert 0 scores higher for every token: it is chosen nearly always

    def busiest_share() -> float:
        layer(x)
        load = layer.routing.load.double()
        return float(load.max() / load.sum())

    before = busiest_share()
    for _ in range(100):
        busiest_share()
        update_router_bias(layer, 0.002)
    assert before > 0.45 and busiest_share() < 0.35, before  # from about half the slots to near a quarter
    assert layer.router_bias[0] < 0  # the busy expert's bias went down


def test_flops_count_the_active_experts_exactly():
    model = GPT(dataclasses.replace(CONFIG, shared_expert=True))
    idx = torch.randint(CONFIG.vocab_size, (2, 16))
    analytic = forward_flops(model.config, 2, 16)
    for dispatch in ("loop", "sorted", "gather"):
        for layer in moe_layers(model):
            layer.dispatch = dispatch
        with torch.no_grad():
            counted = count_with_flop_counter(model, idx)
        assert counted.by_part()["feed_forward"] == analytic.mlp, dispatch
    active = 2 * 32 * 4 + 2 * 2 * (32 * 48 + 24 * 32) + 2 * (32 * 48 + 24 * 32)  # router, 2 experts, shared one
    assert analytic.mlp == CONFIG.n_layers * 2 * 16 * active
    total_expert_parameters = 4 * (32 * 48 + 24 * 32)
    assert sum(p.numel() for p in moe_layers(model)[0].parameters()) > total_expert_parameters > active // 2


@pytest.mark.parametrize("batch, seq", [(1, 1), (2, 16)])
def test_the_roofline_reads_every_used_experts_weights_for_its_share_of_the_tokens(batch, seq):
    """32 tokens x 2 experts each over 4 experts: each expert's weights are read once for 16 rows, not one matrix
    twice as wide for all 32; one token reads only its 2 experts'. The FLOPs are still the active ones."""
    ops = {op.name: op for op in gpt_operations(CONFIG, batch, seq)}
    tokens = batch * seq
    d, hidden, slots, size = 32, 24, 2 * tokens, 4
    experts_read = min(4, slots)
    up = ops["experts' gate and up (2 of 4 a token)"]
    assert up.flops == 2 * slots * d * 2 * hidden
    assert up.bytes == (slots * d + experts_read * d * 2 * hidden + slots * 2 * hidden) * size
    dense = 2 * tokens * d * 2 * hidden * 2 / ((tokens * d + d * 2 * hidden * 2 + tokens * 2 * hidden * 2) * size)
    assert up.intensity < dense  # (one token: its input read once for each of its two experts)
    down = ops["experts' down (2 of 4 a token)"]
    assert sum(ops[name].flops for name in ("router", up.name, down.name)) == forward_flops(CONFIG, batch, seq).mlp // 2
    out = down.make()()
    assert out.shape == (experts_read, -(-slots // experts_read), d)


def test_router_loss_adds_the_balancing_terms_per_target_token_and_trains():
    torch.manual_seed(0)
    model = GPT(CONFIG).train()
    x, y = (torch.randint(CONFIG.vocab_size, (4, 16)) for _ in range(2))
    loss = RouterLoss(balance=0.1, z=0.01)
    total = loss(model, x, y)
    aux = sum(0.1 * layer.routing.balance_loss() + 0.01 * layer.routing.z_loss() for layer in moe_layers(model)) / 2
    torch.testing.assert_close(total, FULL(model, x, y) + aux * y.numel())
    with pytest.raises(ValueError, match="has no MoE layer"):
        loss(GPT(dataclasses.replace(CONFIG, ffn_type="swiglu")), x, y)
    step = TrainingStep(model, torch.optim.AdamW(model.parameters(), lr=3e-3), loss=RouterLoss(bias_rate=0.01))
    losses = [step([(x, y)]).loss for _ in range(25)]
    assert losses[-1] < losses[0] - 0.5
    assert any(layer.router_bias.abs().sum() > 0 for layer in moe_layers(model))  # after_step moved the biases


@pytest.mark.compile
def test_compiled_decoding_runs_the_moe_model_token_for_token():
    torch.manual_seed(0)
    model = GPT(CONFIG).eval()
    idx = torch.randint(CONFIG.vocab_size, (2, 4))
    compiled = CompiledDecoder(model, batch=2, max_len=16).generate(idx, 8)
    assert torch.equal(compiled, model.generate(idx, 8))


# ---- Qwen3-MoE's layout ----


def tiny_qwen3_moe(norm_topk_prob: bool):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=101, hidden_size=32, intermediate_size=48, moe_intermediate_size=24, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=norm_topk_prob, max_position_embeddings=64, tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(config).eval()


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_a_qwen3_moe_checkpoint_gives_transformers_logits(norm_topk_prob, tmp_path):
    theirs = tiny_qwen3_moe(norm_topk_prob)
    theirs.save_pretrained(tmp_path)
    ours = load_hf_llama(tmp_path)
    assert (ours.config.ffn_type, ours.config.n_experts, ours.config.experts_per_token, ours.config.ffn_hidden) == (
        "moe", 4, 2, 24)
    assert ours.config.moe_router == ("topk_softmax" if norm_topk_prob else "softmax_topk")
    idx = torch.randint(0, 101, (2, 19))
    with torch.no_grad():
        torch.testing.assert_close(ours(idx), theirs(idx).logits, rtol=1e-4, atol=1e-5)


def test_our_moe_model_exports_to_qwen3_moe_and_back(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = dataclasses.replace(CONFIG, vocab_size=101, norm="rmsnorm", position_encoding="rope", bias=False,
                                 tie_weights=False, qk_norm=True, n_kv_heads=2, moe_router="topk_softmax")
    ours = GPT(config).eval()
    save_hf_llama(ours, tmp_path)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(theirs).__name__ == "Qwen3MoeForCausalLM"
    idx = torch.randint(0, 101, (2, 13))
    with torch.no_grad():
        torch.testing.assert_close(theirs(idx).logits, ours(idx), rtol=1e-4, atol=1e-5)
    again = load_hf_llama(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(again.state_dict().values(), ours.state_dict().values(), strict=True))
    with torch.no_grad():
        ours.blocks[0].mlp.router_bias[1] = 0.1
    with pytest.raises(WeightsError, match="router_bias is not zero, and the qwen3_moe layout has no place for it"):
        save_hf_llama(ours, tmp_path)
    with pytest.raises(WeightsError, match="no place for shared_expert=True; export a model with"):
        save_hf_llama(GPT(dataclasses.replace(config, shared_expert=True)), tmp_path)


# ---- what a review found ----


@pytest.mark.parametrize("dispatch", ["loop", "sorted", "gather"])
def test_each_dispatch_runs_under_bf16_autocast(dispatch):
    torch.manual_seed(0)
    layer = MoEFeedForward(CONFIG).eval()
    layer.dispatch = dispatch
    x = torch.randn(2, 9, CONFIG.d_model)
    with torch.no_grad():
        full = layer(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            low = layer(x)
    torch.testing.assert_close(low.float(), full, rtol=5e-2, atol=5e-3)


def test_capacity_drops_slots_in_training_only():
    layer = layer64(capacity_factor=0.5).eval()
    x = torch.randn(3, 8, CONFIG.d_model, dtype=torch.float64)
    alone = layer(x[2:])
    torch.testing.assert_close(layer(x)[2:], alone, rtol=0, atol=1e-12)  # its batch-mates change nothing
    layer.train()
    assert not torch.allclose(layer(x)[2:], alone)  # in training the batch's capacity drops its slots, last in order


def test_dropout_reaches_the_shared_expert_once():
    layer = layer64(shared_expert=True, dropout=0.5).train()
    with torch.no_grad():
        layer.gate_up.zero_()  # the routed experts add nothing: what is left is the shared expert
    x = torch.randn(1, 10, CONFIG.d_model, dtype=torch.float64)
    torch.manual_seed(1)
    out = layer(x)
    torch.manual_seed(1)
    layer.dropout(torch.zeros(10, CONFIG.d_model, dtype=torch.float64))  # the routed output's mask, drawn first
    torch.testing.assert_close(out[0], layer.shared(x[0]), rtol=0, atol=0)


def test_the_bias_update_needs_a_training_pass():
    with pytest.raises(ValueError, match="no training forward pass has run"):
        update_router_bias(GPT(CONFIG).eval(), 0.01)


def test_active_parameters_leave_out_the_experts_a_token_does_not_run():
    model = GPT(CONFIG)
    idle = CONFIG.n_layers * (CONFIG.n_experts - CONFIG.experts_per_token) * 3 * CONFIG.d_model * CONFIG.ffn_hidden
    assert active_parameters(model) == model.num_parameters() - idle
    dense = GPT(dataclasses.replace(CONFIG, ffn_type="swiglu"))
    assert active_parameters(dense) == dense.num_parameters()
