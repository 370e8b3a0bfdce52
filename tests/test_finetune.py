"""Instruction tuning end to end at toy scale: chat exchanges through the Trainer (full fine-tuning and LoRA) lower
the held-out answer loss, exchange batches resume exactly, answers end at the end-of-turn token, and ROUGE-L equals
rouge-score's."""

import pytest
import torch
from rouge_score import rouge_scorer

from helpers.measure.answers import answer_questions, answer_summary, rouge_l
from helpers.measure.fine_tuning import LORA_ALPHA, Method, compare_fine_tuning, fine_tuning_cost, lora
from helpers.model.config import GPTConfig
from helpers.model.gpt import GPT
from helpers.text.bpe import train_bpe
from helpers.text.chat import END, encode_exchange, exchange_batches, marker_ids, with_chat_tokens
from helpers.text.instructions import instruction_splits
from helpers.training.batches import ExchangeBatches
from helpers.training.checkpoint import CheckpointError
from helpers.training.lora import add_lora, lora_layers
from helpers.training.trainer import TrainConfig, Trainer


@pytest.fixture(scope="module")
def chat_data():
    splits = instruction_splits()
    train, val = splits["train"][:160], splits["validation"][:24]
    text = "\n".join(f"{e.question} {e.answer}" for e in splits["train"][:600])
    tokenizer = with_chat_tokens(train_bpe(text, 384))
    encode = [[encode_exchange(tokenizer, e.question, e.answer) for e in part] for part in (train, val)]
    keep = [[e for e in part if len(e.ids) <= 96] for part in encode]  # the model's context
    return tokenizer, keep[0], keep[1], val, torch.tensor(tokenizer.encode(text))


def tiny_model(tokenizer) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=96, d_model=64, n_heads=4, n_layers=2,
                         dropout=0.0))


def fine_tune(model, tokenizer, train, val, steps=40, lr=3e-3):
    pad = marker_ids(tokenizer)[END]
    config = TrainConfig(steps=steps, batch_size=8, lr=lr, min_lr=lr / 10, warmup_steps=4, precision="float32",
                         device="cpu", eval_batches=3, weight_decay=0.0)
    trainer = Trainer(model, ExchangeBatches(train, 8, pad, seed=0), exchange_batches(val, 8, pad), config)
    before = trainer.evaluate()
    trainer.fit(progress=False)
    return before, trainer.history["val_loss"][-1], trainer


def test_full_fine_tuning_through_the_trainer_lowers_the_held_out_answer_loss(chat_data):
    tokenizer, train, val, _, _ = chat_data
    before, after, _ = fine_tune(tiny_model(tokenizer), tokenizer, train, val)
    assert after < before - 1.0, (before, after)


def test_lora_through_the_trainer_trains_the_adapters_alone(chat_data):
    tokenizer, train, val, _, text_ids = chat_data
    model = tiny_model(tokenizer)
    pretraining = TrainConfig(steps=60, batch_size=8, lr=3e-3, precision="float32", device="cpu")
    Trainer(model, text_ids, None, pretraining).fit(progress=False)  # LoRA adapts a model that knows the text
    base = {name: p.detach().clone() for name, p in model.named_parameters()}
    add_lora(model, rank=8, alpha=16.0)
    before, after, trainer = fine_tune(model, tokenizer, train, val, lr=1e-2)
    assert after < before - 0.05, (before, after)  # (4.73 to 4.59 nats here; full fine-tuning reaches 4.39)
    trained = {n.replace(".base.", "."): p for n, p in model.named_parameters() if "lora_" not in n}
    assert all(torch.equal(trained[n], base[n]) for n in base)
    assert sum(p.numel() for group in trainer.optimizer.param_groups for p in group["params"]) == sum(
        p.numel() for n, p in model.named_parameters() if "lora_" in n)  # optimizer state for the adapters only


def test_exchange_batches_resume_in_order_and_refuse_other_data(chat_data):
    tokenizer, train, _, _, _ = chat_data
    pad = marker_ids(tokenizer)[END]
    batches = ExchangeBatches(train, 8, pad, seed=3, pack_length=96)
    for _ in range(25):  # past the first epoch
        batches.next()
    state = batches.state_dict()
    expected = [batches.next() for _ in range(3)]
    again = ExchangeBatches(train, 8, pad, seed=3, pack_length=96)
    again.load_state_dict(state)
    assert all(torch.equal(a[0], e[0]) and torch.equal(a[1], e[1]) for a, e in
               ((again.next(), e) for e in expected))
    with pytest.raises(CheckpointError, match="tokens_sha256"):
        ExchangeBatches(train[1:] + train[:1], 8, pad, seed=3).load_state_dict(state)


def answering_model(tokenizer, end_logit: float) -> GPT:
    """A model whose every next token is <|end|> (end_logit > 0) or never is (< 0): its final norm outputs ones,
    and only the head's <|end|> row is not zero."""
    model = GPT(GPTConfig(vocab_size=tokenizer.vocab_size, context_length=96, d_model=16, n_heads=2, n_layers=1,
                          dropout=0.0, tie_weights=False)).eval()
    with torch.no_grad():
        model.ln_f.weight.zero_()
        model.ln_f.bias.fill_(1.0)
        model.lm_head.weight.zero_()
        model.lm_head.weight[marker_ids(tokenizer)[END]] = end_logit
        if end_logit < 0:
            model.lm_head.weight[ord("a")] = 1.0  # then it says "a" forever
    return model


def test_an_answer_ends_at_the_end_of_turn_token_or_at_the_limit(chat_data):
    tokenizer, _, _, questions, _ = chat_data
    ended = answer_questions(answering_model(tokenizer, 1.0), tokenizer, questions[:3], max_tokens=8)
    assert [(a.answer, a.ended) for a in ended] == [("", True)] * 3
    rambling = answer_questions(answering_model(tokenizer, -1.0), tokenizer, questions[:3], max_tokens=8)
    assert [(a.answer, a.ended) for a in rambling] == [("a" * 8, False)] * 3
    assert answer_summary(ended + rambling)["ended"] == 0.5


def test_rouge_l_equals_rouge_scores():
    scorer = rouge_scorer.RougeScorer(["rougeL"])
    pairs = [("Remove any common leading whitespace from every line.", "Remove common leading whitespace."),
             ("the cat sat on the mat", "the cat sat on the mat"), ("nothing alike", "completely different"),
             ("Return a new list, sorted!", "return a sorted list"), ("a b c d e f", "f e d c b a"),
             ("", "reference"), ("x = dedent(text) # 42", "dedent(text) returns 42")]
    for answer, reference in pairs:
        assert rouge_l(answer, reference) == pytest.approx(scorer.score(reference, answer)["rougeL"].fmeasure,
                                                           abs=1e-12), (answer, reference)


# ---- what fine-tuning costs ----

COST_CONFIG = GPTConfig(vocab_size=256, context_length=64, d_model=64, n_heads=4, n_layers=2, dropout=0.0)


def test_every_rank_shares_one_alpha_so_its_update_scale_falls_with_the_rank():
    for rank in (4, 16, 64):
        layers = lora_layers(lora(rank)(GPT(COST_CONFIG))).values()
        assert {(layer.alpha, layer.scaling) for layer in layers} == {(LORA_ALPHA, LORA_ALPHA / rank)}


def test_lora_trains_and_keeps_state_for_its_adapters_only():
    full = fine_tuning_cost("full", COST_CONFIG, 4, 64).state
    rank4 = fine_tuning_cost("lora 4", COST_CONFIG, 4, 64, lora(4)).state
    d, layers = COST_CONFIG.d_model, COST_CONFIG.n_layers
    assert full.trainable == full.parameters == GPT(COST_CONFIG).num_parameters()
    assert full.gradient_bytes == 4 * full.trainable and full.optimizer_bytes == 8 * full.trainable
    assert rank4.trainable == layers * 4 * ((d + 3 * d) + (d + d) + (d + 4 * d) + (4 * d + d))  # r·(in + out) each
    assert rank4.optimizer_bytes == 8 * rank4.trainable and rank4.parameters == full.parameters + rank4.trainable
    int8 = fine_tuning_cost("lora 4 int8", COST_CONFIG, 4, 64, lora(4, int8=True)).state
    assert int8.trainable == rank4.trainable and int8.weight_bytes < 0.6 * rank4.weight_bytes


@pytest.mark.parametrize("name, prepare", [("full", None), ("lora 8", lora(8)), ("lora 8 int8", lora(8, int8=True))])
def test_a_fine_tuning_step_is_planned_as_it_measures(name, prepare):
    planned = fine_tuning_cost(name, COST_CONFIG, 4, 64, prepare)  # SDPA fused on the CPU too
    measured = fine_tuning_cost(name, COST_CONFIG, 4, 64, prepare, device="cpu")
    assert planned.peak_bytes == pytest.approx(measured.peak_bytes, rel=0.02)


def test_lora_needs_less_memory_than_full_fine_tuning():
    peaks = {name: fine_tuning_cost(name, COST_CONFIG, 4, 64, prepare).peak_bytes
             for name, prepare in (("full", None), ("lora", lora(8)), ("int8", lora(8, int8=True)))}
    assert peaks["int8"] < peaks["lora"] < peaks["full"], peaks


def test_exchange_batches_padded_otherwise_are_other_data(chat_data):
    tokenizer, train, _, _, _ = chat_data
    pad = marker_ids(tokenizer)[END]
    state = ExchangeBatches(train, 8, pad, seed=3).state_dict()
    with pytest.raises(CheckpointError, match="tokens_sha256"):
        ExchangeBatches(train, 8, pad, seed=3, pack_length=96).load_state_dict(state)


def test_a_comparison_runs_each_method_with_each_seed_and_puts_its_cost_beside_what_it_learned(chat_data):
    tokenizer, train, val, questions, _ = chat_data
    model = tiny_model(tokenizer)
    pad = marker_ids(tokenizer)[END]
    val = val[:8]
    untrained = Trainer(model, ExchangeBatches(train, 4, pad), exchange_batches(val, 4, pad),
                        TrainConfig(steps=1, batch_size=4, precision="float32", device="cpu")).evaluate()
    methods = [Method("full", None, 3e-3), Method("lora 8", lora(8, train_tokens=marker_ids(tokenizer).values()), 1e-2)]
    full, adapters = compare_fine_tuning(model, tokenizer, train, val, questions[:2], methods, steps=4, batch_size=4,
                                         seeds=(0, 1), max_new_tokens=4, keep_models=True)
    assert full.cost.name == "full" and adapters.cost.name == "lora 8"
    assert adapters.cost.state.trainable < full.cost.state.trainable == full.cost.state.parameters
    for result in (full, adapters):
        assert len(result.answer_loss.samples) == len(result.ended.samples) == 2  # one per seed
        assert len(result.step_seconds.samples) == 2 * (4 - 3)  # the first steps of each seed left out
        assert result.measured_peak_bytes == pytest.approx(result.cost.peak_bytes, rel=0.02)
        assert all(0 <= share <= 1 for share in (*result.ended.samples, *result.rouge_l.samples))
        assert [a.question for a in result.answers] == [q.question for q in questions[:2]]
        assert [a.answer for a in answer_questions(result.model, tokenizer, questions[:2], 4)] == \
            [a.answer for a in result.answers]  # the first seed's model, as it answered
    assert full.answer_loss.median < untrained  # four full steps lower the held-out answer loss
    torch.rand(7)  # whatever ran before: LoRA's random A starts the same with the same seed
    (again,) = compare_fine_tuning(model, tokenizer, train, val, questions[:1], methods[1:], steps=4, batch_size=4,
                                   seeds=(1,), max_new_tokens=1)
    assert again.answer_loss.samples == adapters.answer_loss.samples[1:]
    assert again.model is None  # not kept unless asked
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                 tiny_model(tokenizer).state_dict().values(), strict=True))
