"""The prose quotes no figure a cell measures: a number typed into markdown holds on one machine and contradicts
the outputs on the next, so the cell prints it (in a sentence where the text needs it) and the prose says why.

A figure is a number with a unit of time, speed, memory, ratio or share (`71.47 ms`, `1.3x`, `97%`, `48 MiB`), a
decimal with two or more decimals (`4.23`, a loss) or one in scientific notation (`3.4e-05`; a bare power
such as `1e-6` is an order of magnitude). Not figures: maths
and code spans, numbers the notebook's own code sets, and sentences that cite their source (a link, "published",
"et al."). What is left is a constant or a published figure named in the notebook's `prose_constants`
(helpers.manifest) with the reason it holds everywhere, or a line marked as the recorded machine's (`RECORDED_LINE`).
"""

import re

import nbformat
import pytest

from helpers.manifest import entry
from helpers.notebooks import ROOT, find_notebooks

NOTEBOOKS = find_notebooks()
IDS = [str(p.relative_to(ROOT)) for p in NOTEBOOKS]

UNIT = (r"(?:ms|µs|us|ns|s|min|tok/s|tokens/s|GB/s|GiB/s|MB/s|TiB|GiB|MiB|KiB|TB|GB|MB|KB|"
        r"TFLOP/s|GFLOP/s|%|×|x)")
FIGURE = re.compile(r"(?<![\w.^/$-])(\d[\d,]*(?:\.\d+)?\s?" + UNIT + r"(?![\w/])"
                    r"|\d[\d,]*\.\d+e[-+]?\d+|\d[\d,]*\.\d{2,}(?![.\d]))")
NOT_PROSE = re.compile(r"\$\$.*?\$\$|\$[^$\n]*\$|`[^`\n]*`|<[^>\n]*>", re.S)
CITED = re.compile(r"\]\(https?://|\bpublished\b|et al\.", re.I)
RECORDED_LINE = "> **On the recorded machine:**"
SENTENCE = re.compile(r"(?<=[.;:!?])\s+(?=[A-Z*(\[\"'_])|\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)")

def number(figure: str) -> str:
    return re.match(r"[\d,.]+(?:e[-+]?\d+)?", figure).group().replace(",", "")


def quoted_figures(nb, constants=()) -> list[tuple[int, str, str]]:
    """(cell index, figure, sentence) for each figure a markdown cell states that its notebook does not set."""
    code = "\n".join(c.source for c in nb.cells if c.cell_type == "code").replace("_", "")
    set_by_code = set(re.findall(r"\d+\.?\d*(?:e[-+]?\d+)?", code))
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        lines = [line for line in cell.source.split("\n") if not line.startswith(RECORDED_LINE)]
        for sentence in SENTENCE.split(NOT_PROSE.sub(" ", "\n".join(lines))):
            if CITED.search(sentence):
                continue
            for figure in FIGURE.findall(sentence):
                if number(figure) not in set_by_code and figure not in constants:
                    found.append((index, figure, " ".join(sentence.split())))
    return found


def markdown_notebook(*markdown, code=""):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)]
                                    + [nbformat.v4.new_markdown_cell(m) for m in markdown])


def test_a_measured_figure_in_the_prose_is_found():
    nb = markdown_notebook("Compiled SDPA's median (71.47 ms) is 1.3x eager's.",
                           "The ranks end 3.43e-05 apart; each holds 97% of the parameters, 48 MiB.",
                           "Validation loss 4.23 after training.")
    assert [(i, f) for i, f, _ in quoted_figures(nb)] == [
        (1, "71.47 ms"), (1, "1.3x"), (2, "3.43e-05"), (2, "97%"), (2, "48 MiB"), (3, "4.23")]


def test_what_is_not_a_measured_figure_is_left_alone():
    nb = markdown_notebook(
        "# Chapter 5.1 — Pretraining; see [5.2](02.ipynb) and chapter 3.3.",
        "GELU is $0.5x(1 + \\tanh(0.044715 x^3))$, and `lr=3.5e-4` sets the rate; temperatures 0.2 to 2.0.",
        "The dropout is 0.25 and the warm-up 10% of the steps.",
        "A100 bf16 is 312 TFLOP/s ([datasheet](https://www.nvidia.com/a100)); Brown et al. used 0.5 M tokens.",
        "GPT-2 initialises at 0.02.",
        "> **On the recorded machine:** 71.47 ms.",
        code="DROPOUT = 0.25\nWARMUP = STEPS // 8")
    assert [f for _, f, _ in quoted_figures(nb, {"0.02": "GPT-2's initialisation"})] == ["10%"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_the_prose_quotes_no_figure_a_cell_measures(path):
    nb = nbformat.read(path, as_version=4)
    found = quoted_figures(nb, entry(path.relative_to(ROOT).as_posix()).prose_constants)
    assert not found, "let a cell print these figures, or name a constant in the notebook's prose_constants " \
        "(helpers/manifest.py) with why it holds:\n" + \
        "\n".join(f"  cell {i}: {figure!r} in: {sentence[:160]}" for i, figure, sentence in found)


def test_every_constant_is_still_in_its_notebook():
    for path in NOTEBOOKS:
        text = "\n".join(c.source for c in nbformat.read(path, as_version=4).cells if c.cell_type == "markdown")
        name = path.relative_to(ROOT).as_posix()
        stale = [figure for figure in entry(name).prose_constants if figure not in text]
        assert not stale, f"{name}: drop the prose_constants its prose no longer states: {stale}"


def undiscussed_failures(nb) -> list[str]:
    """The claims (`helpers.measure.claims`) that did not hold in a notebook's saved run, when its markdown never
    speaks of one (no ✗ in any markdown cell): a reader sees the ✗ and no word on what it means."""
    from helpers.measure.claims import claims_in_text

    printed = "\n".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", [])
                        if out.get("output_type") == "stream")
    failed = [line for held, line in claims_in_text(printed) if not held]
    discussed = any("✗" in cell.source for cell in nb.cells if cell.cell_type == "markdown")
    return [] if discussed else failed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_a_claim_that_did_not_hold_is_discussed_in_the_prose(path):
    failed = undiscussed_failures(nbformat.read(path, as_version=4))
    assert not failed, f"{path.name} shows {failed} and its prose never says what a ✗ there means"


def test_an_undiscussed_failed_claim_is_found():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("The check below compares A and B."),
                nbformat.v4.new_code_cell("claim(...)")]
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ A runs: 1.0x\n"),
                           nbformat.v4.new_output("stream", name="stderr",
                                                  text="✗ A beats B: 0.9x  <- does not hold on this machine\n")]
    assert undiscussed_failures(nb) == ["✗ A beats B: 0.9x"]
    nb.cells[0].source += " A ✗ there means the roof was measured low."
    assert undiscussed_failures(nb) == []
