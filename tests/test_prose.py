"""The prose quotes no figure a cell measures: a number typed into markdown holds on one machine and contradicts
the outputs on the next, so the cell prints it (in a sentence where the text needs it) and the prose says why.

What is a figure (`FIGURE`, `COMPARISON`):
- a number with a unit of time, speed, memory, ratio or share: `71.47 ms`, `42 seconds`, `a 3-minute run`,
  `5 µs`, `120 tokens/s`, `1.3x`, `97%`, `48 MiB`;
- a range with such a unit: `2-3x`, `2–3×`, `10 to 20 ms`;
- a count with a k/K/M/B/G/T multiplier and a unit of speed, memory, tokens, parameters or FLOPs: `12k tokens/s`,
  `1.5M tokens`, `3B parameters` (a bare `1.5M`, or `Qwen3-0.6B`, is a name or a size, not a figure);
- a decimal with two or more decimals (`4.23`, a loss) or one in scientific notation (`3.4e-05`; a bare power
  such as `1e-6` is an order of magnitude);
- a comparison of speed, memory or time in words: `twice as fast`, `three times faster`, `3 times the memory`,
  `half the time`.
Not figures: maths (`$...$`), code spans and blocks, HTML tags, link targets, versions (`torch 2.13`,
`Python 3.10`), names (`GPT-2`, `Qwen3-30B-A3B`, `gpt2-small`), bare counts (`8 notebooks`, `4 layers`, years),
the dimensions of a product (`2 x 1024`), sentences that cite their source (a link to a page, "published",
"et al.") and lines marked as the recorded machine's (`RECORDED_LINE`).

What a notebook's prose may state: a figure whose every number its code sets, as a literal number assigned
(`LR = 3e-4`, `STEPS = 20 if SMOKE else 1500`, a default argument) or passed to a call (`range(10)`,
`f(dropout=0.1)`, a claim's threshold `claim("...", ratio <= 1.15)`), directly, inside a list, tuple, set or dict
literal there, negated, or folded from literals (`2**20`); a digit elsewhere in code (a format spec `:.2f`, a name
`gpt2`, a string, a comment, an index, an `if`) sets nothing. IPython's magic lines are dropped before parsing, and
a cell that still does not parse (`%%bash`) sets nothing. Values compare as magnitudes: `1_000_000` is "1,000,000"
and "1M", `1e-3` is "0.001", `2**20` is "1,048,576" (not "1M"), `-0.5` is "0.5", a share `10%` is 10 or 0.1. A
comparison in words is a measurement however its number is set: no code literal exempts it. Anything else is a
constant or a published figure named in the notebook's `prose_constants` (helpers.manifest) with the reason it
holds everywhere.

What README.md, RESULTS.md and the chapter READMEs may state: their regions written by code (between
`<!-- what: who writes it -->` and `<!-- end of ... -->`) are outputs, not prose; a figure in the prose around
them is printed (the same numbers with the same unit) in one of those regions or in the committed outputs of a
notebook that its paragraph, list item or table row names (by path, link or, in a chapter's README, file name); or
it is a constant in `DOCUMENT_CONSTANTS` below with its reason, or on a `RECORDED_LINE`.
"""

import ast
import re
from functools import cache
from pathlib import Path

import nbformat
import pytest

from helpers.manifest import entry
from helpers.notebooks import ROOT, find_notebooks

NOTEBOOKS = find_notebooks()
IDS = [str(p.relative_to(ROOT)) for p in NOTEBOOKS]
DOCUMENTS = [ROOT / "README.md", ROOT / "RESULTS.md", *sorted(ROOT.glob("ch*/README.md"))]
DOCUMENT_IDS = [str(p.relative_to(ROOT)) for p in DOCUMENTS]

# Figures the documents may state, each with why it holds on every machine.
TIME_PLAN = "helpers.measure.time_plan's assumed T4 rates"
DOCUMENT_CONSTANTS: dict[str, dict[str, str]] = {
    "README.md": {
        "9 minutes": "tests/budget.py's target for the parallel part on its reference machine",
        "2 minutes": "tests/budget.py's target for the serial part and for make test-fast there",
        "25%": "analytic: FlashAttention's backward runs five matmuls against four",
        "15-minute": "setup/bootstrap.py's timeout for the clone and for pip (900 s)",
        "10%": "helpers.measure.memory_plan's FRAGMENTATION allowance",
        "1 GiB": "helpers.measure.memory_plan's CUDA_CONTEXT_BYTES allowance",
        "2%": "tests/test_memory_plan.py's tolerance between the plan and the step run for real",
        "20 TFLOP/s": TIME_PLAN, "220 GB/s": TIME_PLAN, "0.3 ms": TIME_PLAN, "0.2 ms": TIME_PLAN,
        "30%": f"{TIME_PLAN} (20 of the T4's 65 fp16 TFLOP/s), and tests/budget.py's MARGIN",
        "60%": f"{TIME_PLAN} (5 of the T4's 8.1 fp32 TFLOP/s)",
        "4 ms": f"{TIME_PLAN}: 12 blocks at 0.3 ms and a call at 0.2 ms",
        "8 minutes": "helpers.measure.time_plan's NOTEBOOK_MINUTES",
        "80 KiB": "the shared memory our Triton backward kernels ask for (helpers/model/flash_triton.py)",
        "0.47 MB": "the size of the text CPython ships in pydoc_data (it moves a little between releases)",
        "45 MB": "the cpu-scale run's checkpoint, fixed by its model: ch05/01 prints 42.7 MiB",
        "15 minutes": "the Makefile's --timeout=900",
        "12 GB": ".ci/matrix.py's DISK_NEEDED_GB for the lowest leg",
    },
}

NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
START = r"(?:(?<![\w.^/$,–-])|(?<=[\s(][-−]))"  # not inside a name, a version, a path or a range;
# a sign after a space is read, the figure is its magnitude
UNIT = (r"(?:ms|µs|μs|us|ns|s|sec|secs|seconds?|min|mins|minutes?|(?<=\s)h|hrs?|hours?|"  # `2h` is algebra
        r"tok/s|tokens/s|TB/s|GB/s|GiB/s|MB/s|MiB/s|TiB|GiB|MiB|KiB|TB|GB|MB|KB|"
        r"[PTGM]FLOP/s|[PTG]FLOPS|%|(?:×|x)(?!\s?\d))")  # `2 x 1024` is a product's dimensions
TIME_ADJECTIVE = r"-(?:second|minute|hour)"  # a 3-minute run
MULTIPLIER = {"k": 1e3, "K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9, "T": 1e12}
COUNTED = r"(?:tok/s|tokens/s|FLOP/s|tokens?|tok|parameters|params|weights|FLOPs?|bytes)"
FIGURE = re.compile(
    START + r"(?:" + NUM + r"(?:\s?[-–]\s?|\s+to\s+)" + NUM + r"\s?" + UNIT  # a range
    + r"|" + NUM + r"\s?[kKMBGT]\s?" + COUNTED                            # 12k tokens/s, 3B parameters
    + r"|" + NUM + r"(?:\s?" + UNIT + r"|" + TIME_ADJECTIVE + r")"        # 71.47 ms, 42 seconds, 3-minute
    + r"|\d+\.\d+e[-+]?\d+|\d+\.\d{2,})(?!\w|\.\d)")                  # 3.4e-05 (not 1e-6), 4.23 (not 2.13.0)
NUMBER_WORDS = r"(?:two|three|four|five|six|seven|eight|nine|ten|a hundred|a thousand)"
COMPARISON = re.compile(
    r"\b(?:(?:" + NUM + "|" + NUMBER_WORDS + r")\s+times|twice|thrice|half)\s+"
    r"(?:as\s+(?:fast|slow|quick|long|much|large|big|small)\b|(?:faster|slower|quicker|longer|shorter|larger|smaller|"
    r"bigger)\b|(?:more|less|the)\s+(?:time|memory|speed|throughput|latency|bytes|size|cost|traffic|tokens/s|FLOPs|"
    r"work)\b)", re.I)  # not "twice as many windows" (a count), not "runs twice more" (again)

MATHS_AND_CODE = re.compile(r"^```.*?^```|\$\$.*?\$\$|\$[^$\n]*\$|`[^`\n]*`|<[^>\n]*>", re.S | re.M)
VERSION = re.compile(r"\b(?:Python|torch|PyTorch|CUDA|cuDNN|transformers|torchao|triton|Triton|tiktoken|NumPy|numpy|"
                     r"nbformat|flash-attn|version|v)\s?\d+(?:\.\d+)+")
LINK_TARGET = re.compile(r"\]\([^)\s]*\)")
CITED = re.compile(r"\]\(https?://(?!colab\.research\.google\.com)|\bpublished\b|et al\.", re.I)
RECORDED_LINE = "> **On the recorded machine:**"
SENTENCE = re.compile(r"(?<=[.;:!?])\s+(?=[A-Z*(\[\"'_])|\n\s*\n|\n(?=\s*(?:[-*]|\d+\.)\s)|\s*\|\s*")
GENERATED = re.compile(r"^<!-- [^\n:]+: [^\n]*-->$.*?^<!-- end of [^\n]*-->$", re.S | re.M)
NAMED_NOTEBOOK = re.compile(r"(?:ch\d\d_\w+/)?(?:\d\d_\w+|solutions)\.ipynb")


UNIT_NAMES = {"sec": "s", "secs": "s", "second": "s", "seconds": "s", "mins": "min", "minute": "min", "minutes": "min",
              "hr": "h", "hrs": "h", "hour": "h", "hours": "h", "μs": "µs", "us": "µs", "×": "x", "tok/s": "tokens/s",
              "token": "tokens", "tok": "tokens", "params": "parameters"}
NUMBER = re.compile(NUM + r"(?:e[-+]?\d+)?")


def number_key(value: float) -> float:
    return float(f"{value:.12g}")


def figure_parts(figure: str) -> tuple[list[float], str]:
    """A figure's numbers (its multiplier applied: 12k is 12000) and its unit, named one way (`3-minute` and
    `3 min` are 3 and "min")."""
    matches = list(NUMBER.finditer(figure))
    numbers = [float(m.group().replace(",", "")) for m in matches]
    unit = figure[matches[-1].end():].strip(" -")
    if re.fullmatch(r"[kKMBGT]\s?" + COUNTED, unit):
        numbers, unit = [n * MULTIPLIER[unit[0]] for n in numbers], unit[1:].strip()
    return [number_key(n) for n in numbers], UNIT_NAMES.get(unit, unit)


def figure_values(figure: str) -> list[set[float]]:
    """The values each number of a figure may be set to in code (a share is also its fraction: 10% is 10 or 0.1)."""
    numbers, unit = figure_parts(figure)
    return [{n, number_key(n / 100)} if unit == "%" else {n} for n in numbers]


def figure_key(figure: str) -> tuple[tuple[float, ...], str]:
    """What a printed figure must match: the same numbers with the same unit."""
    numbers, unit = figure_parts(figure)
    return tuple(numbers), unit


def prose_figures(markdown: str) -> list[tuple[str, str, str, bool]]:
    """(figure, sentence, block, comparison) for each figure the prose of `markdown` states; the block is the
    paragraph, list item or table row around it."""
    found = []
    lines = [line for line in markdown.split("\n") if not line.startswith(RECORDED_LINE)]
    for block in re.split(r"\n\s*\n|\n(?=\s*(?:[-*|]|\d+\.)\s)", "\n".join(lines)):
        prose = VERSION.sub(" ", MATHS_AND_CODE.sub(" ", block))
        for sentence in SENTENCE.split(prose):
            if CITED.search(sentence):
                continue
            text = LINK_TARGET.sub("]", sentence)
            said = " ".join(sentence.split())
            found += [(" ".join(m.group().split()), said, block, True) for m in COMPARISON.finditer(text)]
            found += [(" ".join(m.group().split()), said, block, False)
                      for m in FIGURE.finditer(COMPARISON.sub(" ", text))]
    return found


# --- what code sets ------------------------------------------------------------------------------------------------

def literal(node: ast.AST) -> float | None:
    """The value of a number literal, negated or folded from literals (`-1`, `2**20`); None for anything else."""
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)) and not isinstance(node.value, bool):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = literal(node.operand)
        return None if value is None else -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = literal(node.left), literal(node.right)
        if left is None or right is None or isinstance(node.op, ast.Pow) and abs(right) > 64:
            return None
        operate = {ast.Add: float.__add__, ast.Sub: float.__sub__, ast.Mult: float.__mul__, ast.Div: float.__truediv__,
                   ast.Pow: float.__pow__, ast.FloorDiv: float.__floordiv__}.get(type(node.op))
        if isinstance(node.op, (ast.LShift, ast.RShift)) and isinstance(left, int) and isinstance(right, int) \
                and 0 <= right <= 64:
            return left << right if isinstance(node.op, ast.LShift) else left >> right
        try:
            return None if operate is None else operate(float(left), float(right))
        except (ArithmeticError, ValueError):
            return None
    return None


def set_values(node: ast.AST) -> set[float]:
    """The numbers an assigned or passed expression sets: a literal, either branch of `a if c else b`, the items
    of a list, tuple, set or dict literal, and the bounds of a comparison (a claim's threshold)."""
    value = literal(node)
    if value is not None:
        return {number_key(abs(value))}
    if isinstance(node, ast.IfExp):
        return set_values(node.body) | set_values(node.orelse)
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return set().union(*(set_values(item) for item in node.elts))
    if isinstance(node, ast.Dict):
        return set().union(*(set_values(item) for item in node.values))
    if isinstance(node, ast.Compare):  # a threshold: claim("...", ratio <= 1.15)
        return set().union(*(set_values(item) for item in (node.left, *node.comparators)))
    if isinstance(node, ast.BoolOp):
        return set().union(*(set_values(item) for item in node.values))
    return set()


def code_values(sources: list[str]) -> set[float]:
    """Every number that code assigns or passes as an argument (IPython's magic lines set none)."""
    values = set()
    for source in sources:
        python = "\n".join(line for line in source.split("\n") if not line.lstrip().startswith(("%", "!")))
        try:
            tree = ast.parse(python)
        except SyntaxError:  # a cell in another language (%%bash)
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr)) and node.value is not None:
                set_by = [node.value]
            elif isinstance(node, ast.Call):
                set_by = [*node.args, *(keyword.value for keyword in node.keywords)]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                set_by = [*node.args.defaults, *(d for d in node.args.kw_defaults if d is not None)]
            else:
                continue
            for expression in set_by:
                values |= set_values(expression)
    return values


# --- notebooks -----------------------------------------------------------------------------------------------------

@cache
def read(path: Path):
    return nbformat.read(path, as_version=4)


def quoted_figures(nb, constants=()) -> list[tuple[int, str, str]]:
    """(cell index, figure, sentence) for each figure a markdown cell states that its notebook does not set."""
    set_by_code = code_values([c.source for c in nb.cells if c.cell_type == "code"])
    found = []
    for index, cell in enumerate(nb.cells):
        if cell.cell_type != "markdown":
            continue
        for figure, sentence, _, comparison in prose_figures(cell.source):
            if figure in constants:
                continue
            if comparison or not all(values & set_by_code for values in figure_values(figure)):
                found.append((index, figure, sentence))
    return found


def markdown_notebook(*markdown, code=""):
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(code)]
                                    + [nbformat.v4.new_markdown_cell(m) for m in markdown])


def figures_found(*markdown, code="", constants=()):
    return [f for _, f, _ in quoted_figures(markdown_notebook(*markdown, code=code), constants)]


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


def test_ranges_are_figures():
    assert figures_found("Compiling gains 2-3x here, 2–3× there; a step takes 10 to 20 ms, and 1.5–2 s cold.") \
        == ["2-3x", "2–3×", "10 to 20 ms", "1.5–2 s"]
    assert figures_found("Batches of 1-8 micro-batches, 5–7 samples, GPT-2 small–XL, from 2 to 4 layers.") == []
    assert figures_found("It gains 2-4x.", code="LOW, HIGH = 2, 4") == []
    assert figures_found("It gains 2-5x.", code="LOW, HIGH = 2, 4") == ["2-5x"]


def test_counts_with_a_multiplier_and_a_unit_are_figures():
    assert figures_found("It trains at 12k tokens/s on 1.5M tokens; a 3B parameters model, 2 K tok/s.") \
        == ["12k tokens/s", "1.5M tokens", "3B parameters", "2 K tok/s"]
    assert figures_found("Qwen3-0.6B, Qwen3-30B-A3B, Llama-3-8B and Mistral 7B; gpt2-small is 1.5M in size.") == []
    assert figures_found("Train on 1M tokens.", code="TOKENS = 1_000_000") == []
    assert figures_found("Train on 1M tokens.", code="TOKENS = 2**20") == ["1M tokens"]
    assert figures_found("Train on 1,048,576 tokens/s.", code="TOKENS = 2**20") == []


def test_comparisons_in_words_are_figures_whatever_the_code_sets():
    assert figures_found("It is twice as fast and takes half the time; three times faster, with 4 times the memory "
                         "and thrice the latency.", code="x = f(2, 3, 4, 0.5)") == [
        "twice as fast", "half the time", "three times faster", "4 times the memory", "thrice the latency"]
    assert figures_found("The loop runs twice; half the heads share a key; three times in a row, 4 times each; "
                         "stride T/2 gives twice as many windows; CI runs the tier twice more.") == []
    assert figures_found("It is twice as fast.", constants={"twice as fast": "analytic"}) == []


def test_time_words_and_small_units_are_figures():
    assert figures_found("It took 42 seconds, then 3 minutes, 2 hours, 5 sec, a 7-minute run; 4 µs, 9 μs, 8 us, "
                         "6 ns, 30 ms/step.") == ["42 seconds", "3 minutes", "2 hours", "5 sec", "7-minute", "4 µs",
                                                  "9 μs", "8 us", "6 ns", "30 ms"]
    assert figures_found("Run 5 sequences of 3 steps, 4 heads with 2 hidden layers, a 2 x 1024 batch; 2dh + 2h.") == []
    assert figures_found("The timeout is 900 seconds.", code="run(timeout=900)") == []


def test_versions_names_and_counts_are_not_figures():
    assert figures_found("On torch 2.13 and Python 3.10, transformers 4.51.3; GPT-2, gpt2-small, x1 and sm_75; the "
                         "2024 bug; 8 notebooks of 4 layers, head_dim 64; §7, notebook 02, chapter 5.1; see "
                         "[2.13 ms](https://example.org/a/2.13).") == []
    assert figures_found("A [link](ch02_text/01_tokenization.ipynb#3.14-ms) and `3.14 ms` in code, 2.13.0.") == []


def test_only_numbers_that_code_assigns_or_passes_exempt_a_figure():
    code = ('print(f"{ratio:.2f} and {ratio:.2f}x")  # a comment about 2.5x\n'
            'model = load("gpt2")\nx1 = y[2]\nname = "2.5"\nif speed > 2.5:\n    pass\n%time run()\n')
    prose = "Compiling is 2.5x faster, a change of -2.5%."
    assert figures_found(prose, code=code) == ["2.5x", "2.5%"]
    for setting in ["SPEEDUP = 2.5", "run(speedup=2.5)", "run(2.5)", "SIZES = [1, (2.5, 3)]", "D = {'a': 2.5}",
                    "X = -2.5 if A else 0", "def f(s=2.5): pass", "%%time\nS = 2.5", "S = 5 / 2"]:
        assert figures_found(prose, code=f"{code}\n{setting}") == [], setting
    assert figures_found("The warm-up is 10% of the steps, the rate 1.5e-3, 1,000,000 tokens/s.",
                         code="W = 0.1\nLR = 0.0015\nN = 1_000_000") == []


def test_a_claims_threshold_is_set_by_code():
    prose = "It peaks at no more than 1.15x the checkpoint, within 25% of the prediction."
    assert figures_found(prose, code="if ratio <= 1.15 and abs(gap) < 0.25:\n    pass") == ["1.15x", "25%"]
    assert figures_found(prose, code='claim("peaks low", ratio <= 1.15)\nclaim("close", abs(gap) < 0.25, gap)') == []


def test_code_values_read_magic_cells_and_skip_what_does_not_parse():
    assert code_values(["%%writefile x.py\nN = 7", "%%bash\necho 3 > x", "!pip install x==1.5\nM = 2**10"]) \
        == {7.0, 1024.0}


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_the_prose_quotes_no_figure_a_cell_measures(path):
    nb = read(path)
    found = quoted_figures(nb, entry(path.relative_to(ROOT).as_posix()).prose_constants)
    assert not found, "let a cell print these figures, or name a constant in the notebook's prose_constants " \
        "(helpers/manifest.py) with why it holds:\n" + \
        "\n".join(f"  cell {i}: {figure!r} in: {sentence[:160]}" for i, figure, sentence in found)


def test_every_constant_is_still_in_its_notebook():
    for path in NOTEBOOKS:
        text = " ".join(word for c in read(path).cells if c.cell_type == "markdown" for word in c.source.split())
        name = path.relative_to(ROOT).as_posix()
        stale = [figure for figure in entry(name).prose_constants if figure not in text]
        assert not stale, f"{name}: drop the prose_constants its prose no longer states: {stale}"


# --- the READMEs and RESULTS.md ------------------------------------------------------------------------------------

def printed_figures(text: str) -> set[tuple[tuple[float, ...], str]]:
    return {figure_key(m.group()) for m in FIGURE.finditer(text)}


@cache
def output_figures(path: Path) -> set[tuple[tuple[float, ...], str]]:
    """Every figure a notebook's committed outputs print."""
    return printed_figures("\n".join(out.get("text", "") + out.get("data", {}).get("text/plain", "")
                                     for cell in read(path).cells for out in cell.get("outputs", [])))


def unexplained_figures(text: str, folder: Path, constants=()) -> list[tuple[str, str]]:
    """(figure, sentence) for each figure a document's prose states that none of its generated regions prints,
    nor any notebook its paragraph, list item or table row names, and that is none of `constants`."""
    generated = printed_figures("\n".join(m.group() for m in GENERATED.finditer(text)))
    found = []
    for figure, sentence, block, comparison in prose_figures(GENERATED.sub("\n\n", text)):
        if figure in constants:
            continue
        named = {path for name in NAMED_NOTEBOOK.findall(block)
                 for path in [ROOT / name if name.startswith("ch") else folder / name] if path.is_file()}
        if comparison or figure_key(figure) not in generated.union(*(output_figures(path) for path in named)):
            found.append((figure, sentence))
    return found


def test_a_document_may_state_its_generated_values_and_its_notebooks_outputs(tmp_path):
    text = ("Intro: the course runs for 57 minutes; make test takes 9.0 min.\n\n"
            "<!-- times: written by `python -m helpers record` -->\n| a | 57 min | 0.97x |\n<!-- end of times -->\n\n"
            "| [`01_kv_cache.ipynb`](01_kv_cache.ipynb) | the cache is 1.86x faster | 3.79x the sequences |\n\n"
            f"The engine is 1.86x faster.\n{RECORDED_LINE} 9.5 min\n\n```text\n8.25 ms\n```\n")
    nb = markdown_notebook("text")
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="cached: 1.86x the tokens/s\n")]
    nbformat.write(nb, tmp_path / "01_kv_cache.ipynb")
    assert unexplained_figures(text, tmp_path) == [
        ("9.0 min", "Intro: the course runs for 57 minutes; make test takes 9.0 min."),
        ("3.79x", "3.79x the sequences"), ("1.86x", "The engine is 1.86x faster.")]
    nb.cells[0].outputs[0].text = "cached: 1.86 s, 3.79x the sequences\n"  # another unit is another figure
    nbformat.write(nb, tmp_path / "01_kv_cache.ipynb")
    read.cache_clear()
    output_figures.cache_clear()
    assert [figure for figure, _ in unexplained_figures(text, tmp_path)] == ["9.0 min", "1.86x", "1.86x"]
    assert unexplained_figures(text, tmp_path, {"9.0 min": "x", "3.79x": "y", "1.86x": "z"}) == []


@pytest.mark.parametrize("path", DOCUMENTS, ids=DOCUMENT_IDS)
def test_the_documents_quote_no_figure_they_do_not_show(path):
    name = path.relative_to(ROOT).as_posix()
    found = unexplained_figures(path.read_text(), path.parent, DOCUMENT_CONSTANTS.get(name, {}))
    assert not found, "name the notebook whose output the figure is, put it in a generated region, or name a " \
        "constant in DOCUMENT_CONSTANTS with why it holds:\n" + \
        "\n".join(f"  {figure!r} in: {sentence[:160]}" for figure, sentence in found)


def test_every_document_constant_is_still_in_its_document():
    for name, constants in DOCUMENT_CONSTANTS.items():
        stale = [figure for figure in constants if figure not in " ".join((ROOT / name).read_text().split())]
        assert not stale, f"{name}: drop the DOCUMENT_CONSTANTS it no longer states: {stale}"


# --- claims ---------------------------------------------------------------------------------------------------------

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
    failed = undiscussed_failures(read(path))
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
