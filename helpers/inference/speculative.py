"""Speculative decoding (Leviathan et al. 2023; Chen et al. 2023): a small draft model proposes k tokens one by one,
the large target model scores all of them in one forward pass, and a rule keeps the output exactly the target's.

Decoding one token at a time reads all of the target's weights per token; scoring k + 1 tokens in one pass reads
them once, for about the time of one token while decoding is bound by memory traffic. The rule:

* greedy: keep the draft's tokens up to the first one the target would not have picked, then the target's own
  token there (or, if all k were kept, the target's next one): exactly the target's greedy output;
* sampling: keep draft token x (drawn from the draft's q) with probability min(1, p(x)/q(x)); at the first
  rejection draw from the residual max(0, p - q), normalised; after k kept tokens draw from p. Every token is then
  distributed exactly as the target's sampling would draw it, whatever the draft.

Both models keep a KV cache (`helpers.inference.kv_cache.KVCache`); rejected tokens are rolled back by
truncating it. One sequence at a time: with a batch, the verification pass is no longer nearly free (see
ch06_inference/04_speculative_decoding.ipynb).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..model.decoding import GREEDY, Sampling, check_context, check_decoding, check_prompt
from ..model.gpt import GPT
from ..training.step import token_kl
from .kv_cache import KVCache


@dataclass(frozen=True)
class SpeculativeStats:
    """What one speculative generation did: `rounds` target passes, each checking `proposed / rounds` draft tokens."""

    rounds: int
    proposed: int  # draft tokens the target checked
    accepted: int  # of those, kept

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """New tokens per target forward pass: accepted drafts plus the target's own token each round."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0


def accept_or_resample(p: torch.Tensor, q: torch.Tensor, draft_token: int,
                       generator: torch.Generator | None = None) -> tuple[bool, int]:
    """The sampling rule for one draft token: (kept, token). p and q are the target's and the draft's probabilities
    (vocab,) at this position; `draft_token` was drawn from q. Keeps it with probability min(1, p/q), else draws
    from max(0, p - q) normalised: the returned token is distributed as p."""
    u = torch.rand((), generator=generator, device=p.device)
    if u * q[draft_token] <= p[draft_token]:  # u < p/q without dividing by a q of 0
        return True, draft_token
    residual = (p - q).clamp(min=0)
    return False, int(torch.multinomial(residual / residual.sum(), 1, generator=generator))


def distillation_loss(draft_logits: torch.Tensor, target_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, averaged, for the target's distribution p and the draft's q, from logits of the same
    shape (..., vocab); computed in float32 at least. What a draft is for is agreeing with its target: greedy keeps a
    draft token when both argmaxes agree, and sampling keeps a fraction 1 - TV(p, q) of them, so training the draft
    on p itself (DistillSpec, Zhou et al. 2023) raises acceptance where training on the text only approximates it.
    Pass target logits computed without gradients: only the draft learns."""
    if draft_logits.shape != target_logits.shape:
        raise ValueError(f"draft logits {tuple(draft_logits.shape)} and target logits {tuple(target_logits.shape)} "
                         "must have the same shape: run both models on the same token windows")
    return token_kl(draft_logits, target_logits).mean()


def _probabilities(sampling: Sampling, logits: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
    """(positions, vocab) probabilities of `sampling` for logits (positions, vocab); position j's context is
    `context` plus the first j of the tokens the logits follow (only the penalties read it)."""
    rows = [sampling.logits(logits[j : j + 1], context[:, : context.size(1) - len(logits) + 1 + j] if
                            sampling.penalises else None) for j in range(len(logits))]
    return F.softmax(torch.cat(rows), dim=-1)


def _check_pair(target: GPT, draft: GPT, k: int) -> None:
    if target.config.vocab_size != draft.config.vocab_size:
        raise ValueError(f"the draft's vocabulary ({draft.config.vocab_size} tokens) differs from the target's "
                         f"({target.config.vocab_size}): a draft must share the target's tokenizer")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"k (draft tokens per round) must be a positive integer, got {k!r}")


@torch.no_grad()
def speculative_generate(
    target: GPT,
    draft: GPT,
    idx: torch.Tensor,
    max_new_tokens: int,
    k: int = 4,
    sampling: Sampling = GREEDY,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, SpeculativeStats]:
    """Append `max_new_tokens` tokens to the prompt idx (1, seq) as the target would pick them, drafted `k` at a
    time. Greedy (the default) gives the target's greedy tokens; a sampling `Sampling` draws each token from the
    target's distribution under it, as `GPT.generate` does. Returns the tokens and the statistics."""
    check_prompt(idx, target.config.vocab_size)
    check_decoding(max_new_tokens, sampling, target.config.vocab_size)
    _check_pair(target, draft, k)
    if idx.size(0) != 1:
        raise ValueError(f"speculative decoding here serves one sequence at a time, got a batch of {idx.size(0)}; "
                         "decode the prompts one by one (or batch them without a draft, helpers.inference.serving)")
    # The rule of every decoder: the last new token is never fed back. Drafts stop at the requested length, so a
    # pass reaches at most one position past it (prompt + max_new_tokens, scoring a bonus token that is not needed):
    # that position is used where the context has it, and the last round drafts one token fewer where it has not.
    for name, model in (("target", target), ("draft", draft)):
        try:
            check_context(idx.size(1), max_new_tokens, model.config.context_length)
        except ValueError as err:
            raise ValueError(f"the {name}: {err}") from None
    room = min(idx.size(1) + max_new_tokens, target.config.context_length, draft.config.context_length)
    modes = (target.training, draft.training)
    target.eval()
    draft.eval()
    try:
        return _generate(target, draft, idx, max_new_tokens, k, sampling, generator, room)
    finally:
        target.train(modes[0])
        draft.train(modes[1])


def _generate(target: GPT, draft: GPT, idx: torch.Tensor, max_new_tokens: int, k: int, sampling: Sampling,
              generator: torch.Generator | None, room: int) -> tuple[torch.Tensor, SpeculativeStats]:
    caches = {name: KVCache(model.config, 1, room, model.ln_f.weight.dtype, idx.device)
              for name, model in (("target", target), ("draft", draft))}
    # Each cache holds every kept token but the newest ones, which are fed at the start of the next round: the
    # target always lacks one (the last kept token), the draft one or two (after a round that kept all k drafts).
    prefix = idx[:, :-1]
    if prefix.size(1):
        target(prefix, cache=caches["target"], logits_at=torch.tensor([-1], device=idx.device))
        draft(prefix, cache=caches["draft"], logits_at=torch.tensor([-1], device=idx.device))
    tokens = idx
    target_pending, draft_pending = idx[:, -1:], idx[:, -1:]
    rounds = proposed = accepted = 0
    while tokens.size(1) - idx.size(1) < max_new_tokens:
        # no drafts past the end, nor past the caches' room: the target feeds the pending token and the n drafts
        n = min(k, max_new_tokens - (tokens.size(1) - idx.size(1)), room - caches["target"].length - 1)
        # draft n tokens, one forward pass each (none at all when only the target's next token fits)
        drafts, q_rows = [idx.new_empty(1, 0)], []
        feed = draft_pending
        for _ in range(n):
            logits = draft(feed, cache=caches["draft"])[0, -1:]
            context = torch.cat([tokens, *drafts], dim=1)
            q = _probabilities(sampling, logits, context)
            token = q.argmax(-1, keepdim=True) if sampling.is_greedy else \
                torch.multinomial(q, 1, generator=generator)
            drafts.append(token)
            q_rows.append(q)
            feed = token
        proposal = torch.cat(drafts, dim=1)  # (1, n)
        # the target scores the pending token and every draft in one pass: n + 1 next-token distributions
        start = caches["target"].length
        logits = target(torch.cat([target_pending, proposal], dim=1), cache=caches["target"])[0]
        p = _probabilities(sampling, logits, torch.cat([tokens, proposal], dim=1))
        kept, correction = n, None
        for j in range(n):
            d = int(proposal[0, j])
            if sampling.is_greedy:
                ok, token = int(p[j].argmax()) == d, int(p[j].argmax())
            else:
                ok, token = accept_or_resample(p[j], q_rows[j][0], d, generator)
            if not ok:
                kept, correction = j, token
                break
        if correction is None:  # every draft kept: the target's distribution after the last one gives a bonus token
            correction = int(p[n].argmax()) if sampling.is_greedy else \
                int(torch.multinomial(p[n], 1, generator=generator))
        rounds, proposed, accepted = rounds + 1, proposed + n, accepted + kept
        new = torch.cat([proposal[:, :kept], torch.tensor([[correction]], device=idx.device)], dim=1)
        tokens = torch.cat([tokens, new], dim=1)
        # roll both caches back to the kept tokens: positions up to the pending one (`start`) and the kept drafts;
        # the draft never fed its last proposal, so after a round that kept them all it lags by one
        caches["target"].truncate(start + 1 + kept)
        caches["draft"].truncate(min(caches["draft"].length, start + 1 + kept))
        target_pending = new[:, -1:]
        draft_pending = tokens[:, caches["draft"].length:]  # what the draft has not seen: 1 or 2 tokens
    out = tokens[:, : idx.size(1) + max_new_tokens]
    return out, SpeculativeStats(rounds, proposed, accepted)
