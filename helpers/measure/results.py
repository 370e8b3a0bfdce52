"""A GPU benchmark's results file, rewritten after every item it measures, so a failure loses nothing before it.

A run on a borrowed GPU can fail part-way: one kernel out of memory, one implementation a GPU lacks, a compiler
error, the session ending. Each item (a mode, a preset, a sequence length) runs under `ResultsFile.item(name)`:
an exception in it is recorded in the run's "errors" under that name and the benchmark goes on with the next
item; after each item the JSON file is replaced in one rename (`helpers.system.files.atomic_path`).
"""

from __future__ import annotations

import gc
import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ..system.files import atomic_path

ERROR_CHARS = 1000  # of an error's text kept in the results: compiler errors run to pages


def error_text(err: BaseException) -> str:
    """What a results file keeps of an error: its type and message, truncated."""
    return f"{type(err).__name__}: {err}"[:ERROR_CHARS]


def results_path(out: Path, prefix: str, device_name: str) -> Path:
    """out/<prefix>_<device>.json, e.g. results/attention_tesla-t4.json: one file per GPU model."""
    slug = re.sub(r"[^a-z0-9]+", "-", device_name.lower()).strip("-")
    return Path(out) / f"{prefix}_{slug}.json"


def save_json(path: Path, data: dict) -> None:
    """Replace `path` with `data` as JSON, atomically: a reader (or a crash) never sees half a file."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(data, indent=1))


def save_figure(fig, path: Path, dpi: int = 120) -> None:
    """savefig, atomically (the format from `path`'s suffix)."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format=Path(path).suffix.lstrip("."), dpi=dpi)


class ResultsFile:
    """`run` (a JSON-ready dict the caller fills) saved to `path` after every item."""

    def __init__(self, path: Path, run: dict) -> None:
        self.path, self.run = Path(path), run
        run.setdefault("errors", {})  # item name -> its error: present, so readers need not check for it

    def save(self) -> None:
        save_json(self.path, self.run)

    @contextmanager
    def item(self, name: str) -> Iterator[None]:
        """Run the body as one item: an exception is recorded under `name` (and printed), not raised; then save.

        KeyboardInterrupt and SystemExit still stop the run; what the items before saved stays saved.
        """
        failed = False
        try:
            yield
        except Exception as err:
            self.run["errors"][name] = error_text(err)
            print(f"{name}: {self.run['errors'][name].splitlines()[0]}", file=sys.stderr, flush=True)
            failed = True
        if failed:  # out of the except block, whose traceback held the failed item's tensors: free them now
            gc.collect()
            if torch.cuda.is_initialized():
                torch.cuda.empty_cache()
        self.save()
