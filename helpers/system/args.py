"""argparse types shared by `python -m helpers` and the chapters' scripts: a bad value is a one-line usage error
(exit code 2) from the parser, before any work starts."""

from __future__ import annotations


def positive_int(text: str) -> int:
    """An integer >= 1 (argparse turns the ValueError into a usage error that names the flag)."""
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


positive_int.__name__ = "integer >= 1"  # how argparse names the type in its message


def positive_float(text: str) -> float:
    """A number > 0 (nan refused)."""
    value = float(text)
    if not value > 0:
        raise ValueError(text)
    return value


positive_float.__name__ = "number > 0"
