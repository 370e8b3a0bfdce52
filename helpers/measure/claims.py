"""Claims as checks: where a notebook's prose states a measured relationship ("SDPA is faster than eager
attention", "the KV cache speeds decoding up 10x"), the cell after the measurement states it with `claim`, which
prints ✓ or ✗ with the numbers. A reader on other hardware sees which claims hold there.

At the cpu and gpu scales a claim that fails is printed to stderr (Jupyter shows it on a red background); at the
smoke scale, whose sizes are too small to show the effects, it is reported, not flagged.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from ..system.scale import current_scale

HELD, FAILED = "✓", "✗"


@dataclass(frozen=True)
class Claim:
    text: str  # the relationship, as the prose states it
    held: bool
    evidence: str  # the measured numbers it was checked against

    def line(self) -> str:
        return f"{HELD if self.held else FAILED} {self.text}: {self.evidence}"


def claim(text: str, held: bool, evidence: str, scale: str | None = None) -> None:
    """Print the claim with ✓ or ✗ and its evidence; a ✗ at the cpu or gpu scale goes to stderr.

    Returns nothing, so a claim at the end of a notebook cell adds no output of its own.
    """
    result = Claim(text, bool(held), evidence)
    scale = scale or current_scale()
    if result.held:
        print(result.line(), flush=True)
    elif scale == "smoke":
        print(f"{result.line()} (smoke scale: sizes too small to show it; not flagged)", flush=True)
    else:
        print(f"{result.line()}  <- does not hold on this machine", file=sys.stderr, flush=True)


def claims_in_text(text: str) -> list[tuple[bool, str]]:
    """(held, line) for each claim line printed in a notebook output."""
    return [(line.startswith(HELD), line.removesuffix("  <- does not hold on this machine"))
            for line in text.splitlines() if line.startswith((HELD + " ", FAILED + " "))]
