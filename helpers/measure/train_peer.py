"""The training-speed ladder's peer race: our best rung against transformers' `GPT2LMHeadModel` with the same
configuration (the padded vocabulary too, when our best rung pads it) and weights, trained by the same step with the
same settings (dtype, optimizer, batch, context, attention kernel, accumulation, dropout 0), eager and, when our best
rung is compiled, compiled too; timed interleaved with ours in the same rounds."""

from __future__ import annotations

import copy
import dataclasses

from .peer import PEER_ATTENTION, peer_logits, transformers_peer
from .timing import Spread, timed_rounds, verdict, warm_up
from .train_ladder import Ladder
from .train_rungs import StepSettings, restart


def compare_with_transformers(ladder: Ladder) -> dict:
    """Our best rung against transformers' GPT2LMHeadModel with the same settings, timed in the same rounds:
    eager and, when our best rung is compiled, compiled too.

    The comparison's status says when it could not run (no rung ran, no transformers) or failed (out of
    memory, say: it holds three models), with why; the ladder's measurements stand either way. It is also kept as
    `ladder.comparison`, for `ladder.report()`.
    """
    ladder.comparison = _compare(ladder)
    return ladder.comparison


def _compare(ladder: Ladder) -> dict:
    if ladder.best is None:
        if not ladder.results:
            raise RuntimeError("climb() the ladder before comparing its best rung")
        return {"status": "unavailable",
                "note": "no rung ran: every rung failed or was skipped (each rung's note says why)"}
    best = ladder.best
    try:
        comparison = race_transformers(ladder)
    except Exception as err:
        comparison = {"best_rung": best.name, "settings": best.settings, "status": "error",
                      "note": f"{type(err).__name__}: {err}".splitlines()[0]}
    if comparison.get("status") == "error":
        ladder.release()  # out of the except block, whose traceback held the race's models
    return comparison


def race_transformers(ladder: Ladder) -> dict:
    """The race itself: our best rung's step (restarted from the initial weights) and transformers' model, eager and
    compiled as ours is, warmed up and timed in the same rounds."""
    best, ours = ladder.best, ladder.best_step
    s = StepSettings(**best.settings)
    initial = ladder.model_for(s)  # the initial weights, padded as our best rung's
    restart(ours.step, initial.state_dict(), s)
    out = {"best_rung": best.name, "settings": best.settings, "vocab_size": initial.config.vocab_size,
           "attn_implementation": PEER_ATTENTION.get(s.attn_implementation)}
    try:
        peer = transformers_peer(initial)
    except (ImportError, ValueError) as err:
        return {**out, "status": "unavailable", "note": str(err)}
    same = dataclasses.replace(s, loss_chunk=None)  # transformers' GPT-2 has no chunked head: the plain one
    steps = {"ours": ours,
             "transformers_eager": ladder.bound_step(peer, dataclasses.replace(same, compile=False), peer_logits)}
    if s.compile:
        steps["transformers_compiled"] = ladder.bound_step(copy.deepcopy(peer), same, peer_logits)
    warm = {name: warm_up(step, ladder.warmup) for name, step in steps.items()}
    rounds = timed_rounds(steps, ladder.steps, ladder.device)
    spread = {name: Spread(tuple(seconds)).map(lambda t: s.tokens_per_step / t)
              for name, (seconds, _) in rounds.items()}
    tokens = {name: rate.median for name, rate in spread.items()}
    peer_name = "transformers_compiled" if s.compile else "transformers_eager"
    out |= {"status": "ok",
            "note": "transformers trained with our best rung's settings (those it has), timed interleaved",
            "ours_tokens_per_s": tokens["ours"],
            "transformers_eager_tokens_per_s": tokens["transformers_eager"],
            "transformers_compiled_tokens_per_s": tokens.get("transformers_compiled"),
            **{f"{name}_tokens_per_s_iqr": list(spread[name].quartiles) for name in steps},
            # a ratio only where it holds beyond the noise of the interleaved steps
            "verdict": verdict("ours", spread["ours"], peer_name.replace("_", " "), spread[peer_name]),
            "first_loss": {name: losses[0] for name, losses in warm.items()}}
    del steps, peer, initial
    ladder.release()
    return out
