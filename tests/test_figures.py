"""The diagrams: drawn by figures/draw.py, committed, and embedded where the notebooks show them; the core path's
markdown in short steps with three diagrams or more a notebook."""

import importlib.util
import json
import re
import statistics
import struct
from pathlib import Path

import pytest

from helpers.manifest import DEEP_DIVES
from helpers.notebooks import CORE_PATH

ROOT = Path(__file__).resolve().parents[1]


def load_draw():
    spec = importlib.util.spec_from_file_location("draw", ROOT / "figures" / "draw.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])  # IHDR: width, height


def test_every_figure_is_committed_shown_by_a_notebook_and_its_copy_is_current(capsys):
    draw = load_draw()
    shown = {n for path in draw.notebooks() for names in draw.shown_figures(path).values() for n in names}
    assert len(draw.FIGURES) >= 6
    assert shown == set(draw.FIGURES), "a figure no notebook shows, or a notebook showing a figure not drawn"
    assert all((draw.HERE / f"{name}.png").is_file() for name in draw.FIGURES)
    assert draw.main(["--check"]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("name", list(load_draw().FIGURES))
def test_the_script_draws_each_committed_figure_at_its_size_with_no_version_stamp(name):
    draw = load_draw()
    drawn = draw.render(name)
    assert png_size(drawn) == png_size((draw.HERE / f"{name}.png").read_bytes())
    assert b"matplotlib" not in drawn.lower()  # no Software metadata: a redraw changes only what is drawn
    assert draw.render(name) == drawn


def test_a_stale_copy_fails_the_check_and_an_unknown_figure_is_refused(tmp_path, monkeypatch, capsys):
    draw = load_draw()
    chapter = tmp_path / "ch09_test"
    chapter.mkdir()
    figures = tmp_path / "figures"
    figures.mkdir()
    (figures / "kv_cache.png").write_bytes(draw.render("kv_cache"))
    cell = {"cell_type": "markdown", "id": "a", "metadata": {}, "source": ["see ![the cache](attachment:kv_cache.png)"]}
    notebook = chapter / "01.ipynb"
    notebook.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    monkeypatch.setattr(draw, "ROOT", tmp_path)
    monkeypatch.setattr(draw, "HERE", figures)
    assert draw.main(["--check"]) == 1 and "ch09_test/01.ipynb: kv_cache.png" in capsys.readouterr().err
    assert draw.embed(notebook, figures) and not draw.embed(notebook, figures)  # written once, then unchanged
    assert draw.main(["--check"]) == 0
    cell["source"] = ["![a](attachment:no_such_figure.png)"]
    notebook.write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
    with pytest.raises(SystemExit, match="no figure \\['no_such_figure'\\]"):
        draw.embed(notebook, figures)


def core_markdown(path):
    """The words of each markdown cell of a notebook (image links left out) and the diagrams it shows."""
    cells = [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "markdown"]
    sources = ["".join(c["source"]) for c in cells]
    words = [len(re.sub(r"!\[[^\]]*\]\([^)]*\)", "", source).split()) for source in sources]
    return words, sum(len(re.findall(r"\]\(attachment:", source)) for source in sources)


def test_the_core_path_is_short_steps_with_a_picture_for_each_idea():
    """One idea a markdown cell (the median cell 70 words at most, none over 200) and three diagrams or more in every
    core notebook: the course reads as steps, not as a paper."""
    words, diagrams = {}, {}
    for name in CORE_PATH:
        words[name], diagrams[name] = core_markdown(ROOT / name)
    every = [n for cells in words.values() for n in cells]
    assert statistics.median(every) <= 70, statistics.median(every)
    assert {name: max(cells) for name, cells in words.items() if max(cells) > 200} == {}
    assert {name: n for name, n in diagrams.items() if n < 3} == {}
    assert sum(diagrams.values()) >= 24


def test_the_deep_dives_show_their_ideas_as_diagrams():
    """The lesson notebooks off the core path (solutions aside) show at least ten diagrams in all: paged blocks, the
    pipeline bubble, a ring all-reduce, FlashAttention's tiles and the like are pictures before they are code."""
    draw = load_draw()
    assert len(DEEP_DIVES) >= 10 and not set(DEEP_DIVES) & set(CORE_PATH)
    shown = {name: sum(map(len, draw.shown_figures(ROOT / name).values())) for name in DEEP_DIVES}
    assert sum(shown.values()) >= 10, shown
