"""Running the course's notebooks headless, and keeping their first code cell (the bootstrap) in sync.

The repository address lives in `helpers.system.repository`, once: `python -m helpers sync-bootstrap` writes it into the
first code cell of every notebook, so a fork changes `REPOSITORY_URL` and runs that command.
"""

from __future__ import annotations

import ast
import datetime
import html
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .manifest import CORE_PATH, DEEP_DIVES
from .measure.claims import claims_in_text
from .system.args import positive_float, positive_int
from .system.cli import Command
from .system.files import atomic_path
from .system.repository import REPOSITORY_URL, REVISION, ROOT

if TYPE_CHECKING:  # imported where used: `python -m helpers COMMAND --help` stays fast (nbformat with jsonschema: ~1 s)
    import nbformat

BOOTSTRAP_SOURCE = """\
# @title Setup (run first): the course's helpers, cloned and installed on a fresh runtime { display-mode: "form" }
import pathlib
import runpy
import subprocess

REPOSITORY_URL = "<<URL>>"
REVISION = "<<REVISION>>"  # the branch or tag these notebooks belong to
here = pathlib.Path.cwd().resolve()
root = next((d for d in (here, *here.parents) if (d / "setup/bootstrap.py").is_file()), here / "gpt-from-scratch-fast")
if not (root / "setup/bootstrap.py").is_file():  # a fresh runtime: fetch the course
    git = subprocess.run(["git", "clone", "--quiet", "--depth=1", f"--branch={REVISION}", REPOSITORY_URL, str(root)],
                         capture_output=True, text=True, timeout=900)
    if git.returncode:
        raise SystemExit(f"setup failed at `git clone`: {git.stderr.strip()}\\nCheck that this runtime reaches the "
                         f"internet, or clone {REPOSITORY_URL} yourself and open the notebook there.")
helpers = runpy.run_path(str(root / "setup/bootstrap.py"))["course_helpers"](root)  # install, import and check them
print(helpers.environment_line())"""
# Shown collapsed: Colab's form view (the @title line) and JupyterLab's hidden source.
BOOTSTRAP_METADATA = {"cellView": "form", "jupyter": {"source_hidden": True}}


def bootstrap_source(url: str = REPOSITORY_URL, revision: str = REVISION) -> str:
    return BOOTSTRAP_SOURCE.replace("<<URL>>", url).replace("<<REVISION>>", revision)


def find_notebooks(root: Path = ROOT) -> list[Path]:
    """Every course notebook, in chapter order."""
    return sorted(p for p in root.glob("ch*/**/*.ipynb")
                  if not any(part.startswith(".") for part in p.relative_to(root).parts))  # checkpoints, temporaries


def is_solutions(path: Path) -> bool:
    """A chapter's solutions notebook (worked answers to its exercises), as opposed to a lesson."""
    return path.name == "solutions.ipynb"


PATH_MARKS = ("**Core path", "**Deep dive")  # how the title cell's line on the path begins


def notebook_label(name: str, root: Path = ROOT) -> str:
    """'3.1 Self-attention from scratch' for the notebook whose title is '# Chapter 3.1 — Self-attention from
    scratch'."""
    import nbformat

    heading = nbformat.read(root / name, as_version=4).cells[0].source.split("\n")[0]
    return heading.removeprefix("# Chapter ").replace(" — ", " ", 1)


def path_line(path: Path, root: Path = ROOT) -> str | None:
    """The title cell's line that places a lesson on the course's path: its step on the core path, with the
    notebooks before and after it and the deep dives into it, or the core notebook a deep dive extends. None for
    a solutions notebook and a notebook outside the course."""
    name = path.resolve().relative_to(root.resolve()).as_posix()

    def link(target: str, label: str | None = None) -> str:
        return f"[{label or notebook_label(target, root)}]({os.path.relpath(root / target, (root / name).parent)})"

    if name in DEEP_DIVES:
        return f"**Deep dive**, extending the core path's {link(DEEP_DIVES[name])}."
    if name not in CORE_PATH:
        return None
    step = CORE_PATH.index(name)
    parts = [f"**Core path, {step + 1} of {len(CORE_PATH)}.**"]
    parts.append(f"After {link(CORE_PATH[step - 1])}; next:" if step else "Start here; next:")
    parts.append(f"{link(CORE_PATH[step + 1])}." if step + 1 < len(CORE_PATH)
                 else "the deep dives, listed in each core notebook's title.")
    dives = [dive for dive, core in DEEP_DIVES.items() if core == name]
    if dives:
        numbers = ", ".join(link(d, notebook_label(d, root).split(" ")[0]) for d in dives)
        parts.append(f"Deep dives from here: {numbers}.")
    return " ".join(parts)


def colab_link(path: Path, url: str = REPOSITORY_URL, revision: str = REVISION, root: Path = ROOT) -> str:
    """A Markdown link that opens the notebook, as committed at `revision`, in Google Colab."""
    repository = url.removeprefix("https://github.com/").removesuffix(".git")
    return (f"[Open in Colab](https://colab.research.google.com/github/{repository}/blob/{revision}/"
            f"{path.resolve().relative_to(root.resolve()).as_posix()})")


def sync_bootstrap(path: Path, url: str = REPOSITORY_URL, root: Path = ROOT) -> bool:
    """Make the notebook's first code cell the bootstrap cell, and put its Colab link and its place on the course's
    path (`path_line`) under the title; True when the file changed."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    before = nbformat.writes(nb)
    source = bootstrap_source(url)
    first = next((c for c in nb.cells if c.cell_type == "code"), None)
    if first is None or "REPOSITORY_URL" not in first.source:  # none yet: after the title and introduction
        first = nbformat.v4.new_code_cell(source)
        nb.cells.insert(next((i for i, c in enumerate(nb.cells) if c.cell_type == "code"), len(nb.cells)), first)
    first.source = source
    first.metadata.update(BOOTSTRAP_METADATA)
    title = nb.cells[0]
    if title.cell_type == "markdown":
        heading, *body = [line for line in title.source.split("\n")
                          if not line.startswith(("[Open in Colab](", *PATH_MARKS))]
        while body and not body[0].strip():
            body.pop(0)
        on_path = path_line(path, root)
        title.source = "\n".join([heading, "", colab_link(path, url, root=root), *(["", on_path] if on_path else []),
                                   *(["", *body] if body else [])])
    if nbformat.writes(nb) == before:
        return False
    nbformat.write(nb, path)
    return True


def terminal_text(text: str) -> str:
    """What a terminal shows for `text`: a carriage return rewinds the line, so of a progress bar's redraws only
    the last one stays."""
    lines = []
    for line in text.split("\n"):
        drawn = [part for part in line.split("\r") if part]
        lines.append(drawn[-1] if drawn else "")
    return "\n".join(lines)


def widget_text(view: dict, state: dict) -> str | None:
    """The final text of a tqdm notebook bar (an HBox of label, bar and counts) from the saved widget state."""
    box = state.get(view.get("model_id"), {})
    parts = [state.get(child.removeprefix("IPY_MODEL_"), {}) for child in box.get("state", {}).get("children", [])]
    texts = [html.unescape(p["state"]["value"]) for p in parts if p.get("model_name") == "HTMLModel"]
    return " ".join(t.replace("\u2007", " ").strip() for t in texts) or None


FINISHED_BAR = re.compile(r"^.*\b100%.*?\b(\d+)/\1\b.*\n?", re.M)  # tqdm's last redraw: 100% ... n/n


def clean_outputs(nb: nbformat.NotebookNode) -> nbformat.NotebookNode:
    """What a reader of the saved notebook needs from its streams: a bar's redraws joined to the line they redraw,
    consecutive stream outputs merged and their carriage-return redraws collapsed; widget bars (which show as
    nothing on GitHub) read as their final text; then finished progress bars dropped from stderr (they say only
    that a loop ended; one that stopped early stays) and empty streams dropped; no widget state left in the
    metadata."""
    import nbformat

    widgets = nb.metadata.pop("widgets", {}).get("application/vnd.jupyter.widget-state+json", {}).get("state", {})
    for cell in nb.cells:
        if "outputs" not in cell:
            continue
        outputs = []
        for out in cell.outputs:
            view = out.get("data", {}).get("application/vnd.jupyter.widget-view+json")
            text = widget_text(view, widgets) if view is not None else None
            if text is not None:  # a progress bar; another widget keeps its text fallback
                out = nbformat.v4.new_output("stream", name="stderr", text=text + "\n")
            elif view is not None:
                del out.data["application/vnd.jupyter.widget-view+json"]
                if not out.data:
                    continue
            outputs.append(out)
        outputs = _merge_streams(_rejoin_redraws(outputs))
        for out in outputs:
            if out.output_type == "stream":
                out.text = terminal_text(out.text)
                if out.name == "stderr":
                    out.text = FINISHED_BAR.sub("", out.text)
        cell.outputs = _merge_streams([out for out in outputs if out.output_type != "stream" or out.text.strip()])
    return nb


def _rejoin_redraws(outputs: list) -> list:
    """A stream output that starts with a carriage return redraws the line its stream left open, even when other
    outputs came between (a progress bar around a loop that prints): its text joins that earlier output."""
    kept, open_line = [], {}
    for out in outputs:
        if out.output_type == "stream":
            earlier = open_line.get(out.name)
            if earlier is not None and out.text.startswith("\r"):
                earlier.text += out.text
                open_line[out.name] = None if earlier.text.endswith("\n") else earlier
                continue
            open_line[out.name] = None if out.text.endswith("\n") else out
        kept.append(out)
    return kept


def _merge_streams(outputs: list) -> list:
    """Consecutive outputs of the same stream as one (the first one takes the text of those after it)."""
    merged = []
    for out in outputs:
        if out.output_type == "stream" and merged and merged[-1].output_type == "stream" \
                and merged[-1].name == out.name:
            merged[-1].text += out.text
        else:
            merged.append(out)
    return merged


VIRTUAL_DEVICE_SOURCE = """\
from helpers.system.virtual_device import ACCELERATOR, virtual_accelerator
DEVICES_ON_THE_CPU = [name for name in globals() if name.endswith("DEVICE") and str(globals()[name]) == "cpu"]
if DEVICES_ON_THE_CPU:
    VIRTUAL_DEVICE = virtual_accelerator()  # held, so it stays entered for the rest of the kernel's life
    VIRTUAL_DEVICE.__enter__()
    for name in DEVICES_ON_THE_CPU:
        globals()[name] = str(ACCELERATOR)
"""


@dataclass
class NotebookRun:
    path: Path
    seconds: float
    error: str | None = None


def execute_notebook(path: Path, output: Path | None = None, smoke: bool = True,
                     timeout: int = 900, threads: int | None = None,
                     metadata: dict | None = None, virtual_device: bool = False) -> NotebookRun:
    """Run every cell in a fresh kernel (in the notebook's folder); optionally save the result.

    `virtual_device`: after the parameters cell, the notebook's devices (`DEVICE`, `TRAIN_DEVICE`, ...) that are
    the CPU become `helpers.system.virtual_device.ACCELERATOR`, a second device on this CPU, so a tensor left on
    the CPU fails as it would on a GPU. Only for checking: the saved notebook has the extra cell.

    A failing cell, a cell running past `timeout` seconds and a kernel that dies (out of host memory, say) all
    end this notebook's run with its `error`, never the caller's loop over notebooks; the outputs up to there
    are saved all the same, so the report shows where it stopped.
    """
    import nbformat
    from nbclient import NotebookClient  # here, not at import: `python -m helpers --help` stays fast
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError
    from traitlets.config import Config

    path = Path(path)
    nb = nbformat.read(path, as_version=4)
    if virtual_device:
        parameters = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
        nb.cells.insert(parameters + 1, nbformat.v4.new_code_cell(VIRTUAL_DEVICE_SOURCE))
    # Progress bars redraw in place in a live notebook; in a saved one every redraw stays, so draw rarely.
    env = dict(os.environ, COURSE_SMOKE="1" if smoke else "0", TQDM_MININTERVAL="30")
    if threads is not None:  # torch reads it at start-up: every kernel computes with the same thread count
        env["OMP_NUM_THREADS"] = str(threads)
    running = ["before the first cell"]  # where the run is: the error of a timeout or a dead kernel names it

    def started(cell, cell_index: int) -> None:
        first_line = cell.source.strip().split("\n")[0]
        number = sum(c.cell_type == "code" for c in nb.cells[: cell_index + 1])  # as a learner counts them
        running[0] = f"code cell {number} ({first_line!r})"

    # The kernel talks to this process over Unix domain sockets where there are some: no TCP port is opened (and
    # ipykernel has no plain-text TCP channel to warn about). Their files go to a short absolute path (the kernel
    # runs in the notebook's folder; a socket path has at most ~100 characters).
    sockets = tempfile.TemporaryDirectory(prefix="kernel-")
    unix = {"KernelManager": {"transport": "ipc", "ip": os.path.join(sockets.name, "ipc")}}
    local = unix if os.name == "posix" else {}
    client = NotebookClient(nb, config=Config(local), timeout=timeout, kernel_name="python3", on_cell_start=started,
                            resources={"metadata": {"path": str(path.parent)}})
    start = time.perf_counter()
    error = None
    try:
        with sockets:
            client.execute(env=env)
    except CellExecutionError as err:
        error = str(err)
    except CellTimeoutError:
        error = f"{running[0]} timed out after {timeout} s"
    except DeadKernelError:
        error = f"kernel died (out of host memory?) in {running[0]}"
    except Exception as err:  # nbclient failing in its own clean-up once the kernel is gone
        # A SIGINT or SIGTERM to this process makes nbclient shut the kernel down at once; its own clean-up then
        # fails (an AssertionError on the kernel manager it already released). The kernel is gone either way: this
        # notebook stops here, its outputs so far are saved, and the caller's loop goes on.
        if client.km is not None:
            raise
        error = f"the kernel was shut down in {running[0]} (this process got a SIGINT or SIGTERM: {err!r})"
    seconds = time.perf_counter() - start
    if metadata is not None:
        nb.metadata["course"] = {**metadata, "wall_seconds": round(seconds, 1)}
    if output is not None:
        with atomic_path(output) as tmp:
            nbformat.write(clean_outputs(nb), tmp)
    return NotebookRun(path, seconds, error)


def recorded_seconds(path: Path) -> float | None:
    """The wall time of a notebook's last recording (`python -m helpers record`), if it has one."""
    import nbformat

    meta = nbformat.read(path, as_version=4).metadata.get("course", {})
    return meta.get("wall_seconds")


def busy_cores(seconds: float = 3.0) -> float | None:
    """How many cores' worth of CPU time the whole machine used over `seconds` (Linux /proc/stat), while this
    process sleeps: what other programs take from a measurement. None where /proc/stat is missing."""
    def sample():
        with open("/proc/stat") as f:
            fields = [int(x) for x in f.readline().split()[1:]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
        return sum(fields) - idle, sum(fields)
    try:
        busy0, total0 = sample()
        time.sleep(seconds)
        busy1, total1 = sample()
    except OSError:
        return None
    return (busy1 - busy0) / max(total1 - total0, 1) * (os.cpu_count() or 1)


def remaining_estimate(paths: list[Path], done: int) -> str:
    """Minutes left by the recorded wall times of the notebooks not yet run ("" when some have none)."""
    left = [recorded_seconds(p) for p in paths[done:]]
    if not left or any(s is None for s in left):
        return ""
    return f"; about {sum(left) / 60:.0f} min left by the recorded times"


RECORDED_SECTIONS = {  # what `python -m helpers record` writes, between these markers, into these documents
    "times": ("RESULTS.md", "<!-- recorded times: written by `python -m helpers record` -->",
              "<!-- end of recorded times -->"),
    "claims": ("RESULTS.md", "<!-- claims: written by `python -m helpers record` -->", "<!-- end of claims -->"),
    "sample": ("README.md", "<!-- sample: written by `python -m helpers record` -->", "<!-- end of sample -->"),
    "front": ("README.md", "<!-- what you need and the time: written by `python -m helpers record` -->",
              "<!-- end of what you need -->"),
}
READING_WORDS_PER_MINUTE = 200  # a reading speed for technical prose
SAMPLE_NOTEBOOK = "ch05_training/01_pretraining.ipynb"  # the README shows the last sample of its committed run
SAMPLE_TAG = "readme-sample"  # its cell that prints the samples, one `step  'text'` line per step


def recorded_times_table(paths: list[Path], root: Path = ROOT) -> str:
    """The table of each notebook's last recording: wall time, machine, threads, torch, calibration, date; then the
    minutes of the core path (what `make core` runs), of the lessons (`make course`), of the solutions
    (`make solutions`) and of both."""
    import nbformat

    rows = ["| notebook | minutes | machine | threads | torch | calibration | recorded |",
            "|---|---:|---|---:|---|---|---|"]
    seconds = {"lessons": 0.0, "solutions": 0.0}
    core = 0.0
    for path in paths:
        meta = nbformat.read(path, as_version=4).metadata.get("course")
        name = path.resolve().relative_to(root).as_posix()
        if meta is None:
            rows.append(f"| `{name}` | not recorded | | | | | |")
            continue
        seconds["solutions" if is_solutions(path) else "lessons"] += meta["wall_seconds"]
        core += meta["wall_seconds"] if name in CORE_PATH else 0.0
        bf16 = ", native bf16" if meta.get("bf16_native") else ""
        rows.append(f"| `{name}` | {meta['wall_seconds'] / 60:.1f} | {meta['machine']} ({meta['device']}{bf16}) | "
                    f"{meta['threads']} | {meta['torch']} | {meta.get('calibration', 'not named')} | "
                    f"{meta['recorded']} |")
    rows += [f"| core path (`make core`) | {core / 60:.0f} | | | | | |",
             f"| lessons (`make course`) | {seconds['lessons'] / 60:.0f} | | | | | |",
             f"| solutions (`make solutions`) | {seconds['solutions'] / 60:.0f} | | | | | |",
             f"| all | {sum(seconds.values()) / 60:.0f} | | | | | |"]
    return "\n".join(rows)


def notebook_claims(path: Path) -> list[tuple[bool, str]]:
    """(held, line) of every claim (`helpers.measure.claims.claim`) in a notebook's saved outputs."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    text = "\n".join(out.get("text", "") for cell in nb.cells for out in cell.get("outputs", [])
                     if out.get("output_type") == "stream")
    return claims_in_text(text)


def claims_table(paths: list[Path], root: Path = ROOT) -> str:
    """The table of the claims checked in each notebook's committed run, ✓ held, ✗ did not."""
    rows = ["| notebook | claim, as checked in the committed run |", "|---|---|"]
    for path in paths:
        name = path.resolve().relative_to(root).as_posix()
        rows += [f"| `{name}` | {line.replace('|', '/')} |" for _, line in notebook_claims(path)]
    return "\n".join(rows)


def readme_sample(path: Path, root: Path = ROOT) -> str:
    """The README's sample of the model's text: the last line that the notebook's cell tagged `readme-sample`
    printed in its committed run, after the prompt, and where it comes from."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cell = next((c for c in nb.cells if SAMPLE_TAG in c.metadata.get("tags", [])), None)
    if cell is None:
        raise ValueError(f"{path} has no cell tagged {SAMPLE_TAG!r}: tag the cell that prints the samples")
    printed = "".join(out.get("text", "") for out in cell.get("outputs", []) if out.get("output_type") == "stream")
    prompt = re.search(r"prompt: ('.*')\)", printed)
    samples = re.findall(r"^\s*(\d+)  ('.*')$", printed, flags=re.M)
    if prompt is None or not samples:
        raise ValueError(f"{path}'s {SAMPLE_TAG!r} cell printed no samples: run `python -m helpers record` on it")
    step, text = samples[-1]
    meta = nb.metadata.get("course", {})
    recorded = (f" (a {meta['wall_seconds'] / 60:.1f}-minute notebook on {meta['machine']}, {meta['threads']} "
                f"threads, recorded {meta['recorded']})" if meta else "")
    name = path.resolve().relative_to(root.resolve()).as_posix()
    block = (ast.literal_eval(prompt.group(1)) + ast.literal_eval(text)).replace("```", "` ` `")
    return (f"```text\n{block}\n```\n\nThe prompt and the model's continuation after {int(step):,} training steps, "
            f"in the committed run of [`{name}`]({name}){recorded}. Your run prints its own.")


def front_door(paths: list[Path], root: Path = ROOT) -> str:
    """What a learner needs and how long the course takes: the core path's and the lessons' recorded minutes (their
    machine named), and the words of their markdown at READING_WORDS_PER_MINUTE."""
    import nbformat

    minutes, words, machine = {"core": 0.0, "lessons": 0.0}, {"core": 0, "lessons": 0}, None
    for path in paths:
        if is_solutions(path):
            continue
        nb = nbformat.read(path, as_version=4)
        meta = nb.metadata.get("course") or {}
        machine = machine or (meta.get("machine"), meta.get("threads"))
        prose = sum(len(cell.source.split()) for cell in nb.cells if cell.cell_type == "markdown")
        parts = ["lessons", "core"] if path.resolve().relative_to(root).as_posix() in CORE_PATH else ["lessons"]
        for part in parts:
            minutes[part] += meta.get("wall_seconds", 0.0) / 60
            words[part] += prose
    # rounded (words to the thousand, reading to 5 minutes), so that an edited sentence leaves the section as it is
    reading = {part: words[part] / READING_WORDS_PER_MINUTE for part in words}
    return (f"**You need** Python 3.10 or newer and a little PyTorch (tensors, `nn.Module`, a training step); no GPU. "
            f"`make lab` sets everything up, with PyTorch's CPU build on a Linux machine without an NVIDIA GPU.\n\n"
            f"**Time**: the {len(CORE_PATH)} notebooks of the core path compute for {minutes['core']:.0f} minutes and "
            f"all the lessons for {minutes['lessons']:.0f} (recorded on {machine[0]}, {machine[1]} threads); their "
            f"prose is about {round(words['core'], -3):,} words on the core path (about "
            f"{5 * round(reading['core'] / 5)} minutes of reading at {READING_WORDS_PER_MINUTE} words a minute) and "
            f"{round(words['lessons'], -3):,} in all (about {reading['lessons'] / 60:.0f} hours).")


def recorded_contents(paths: list[Path] | None = None, root: Path = ROOT) -> dict[str, str]:
    """What belongs between each pair of RECORDED_SECTIONS markers, from the notebooks' committed runs."""
    paths = paths or find_notebooks(root)
    return {"times": recorded_times_table(paths, root), "claims": claims_table(paths, root),
            "sample": readme_sample(root / SAMPLE_NOTEBOOK, root), "front": front_door(paths, root)}


def update_recorded(paths: list[Path] | None = None, root: Path = ROOT) -> list[str]:
    """Write the recorded times and the claims tables into RESULTS.md and the sample into the README, between their
    markers; returns the documents that changed."""
    contents = recorded_contents(paths, root)
    changed = []
    for document in dict.fromkeys(doc for doc, _, _ in RECORDED_SECTIONS.values()):
        path = root / document
        text = original = path.read_text()
        for key, (doc, start, end) in RECORDED_SECTIONS.items():
            if doc != document:
                continue
            if start not in text or end not in text:
                raise ValueError(f"{path} has no {key} markers: add the lines {start!r} and {end!r}")
            head, rest = text.split(start, 1)
            _, tail = rest.split(end, 1)
            text = f"{head}{start}\n{contents[key]}\n{end}{tail}"
        if text != original:
            with atomic_path(path) as tmp:
                tmp.write_text(text)
            changed.append(document)
    return changed


def run_notebooks(paths: list[Path], out: Path, smoke: bool, timeout: int) -> int:
    """Execute `paths` one after another into `out` (the course's layout), printing each one's time and the time
    left by the recorded times; returns the number that failed."""
    print(f"executing {len(paths)} notebook(s) at {'smoke' if smoke else 'default'} scale into {out}/")
    failed = 0
    for i, path in enumerate(paths):
        rel = path.resolve().relative_to(ROOT) if path.resolve().is_relative_to(ROOT) else Path(path.name)
        print(f"[{i + 1}/{len(paths)}] {rel}{'' if smoke else remaining_estimate(paths, i)}", flush=True)
        run = execute_notebook(path, out / rel, smoke=smoke, timeout=timeout)
        failed += run.error is not None
        print(f"{'FAIL' if run.error else 'ok':>4}  {run.seconds:7.1f} s  {rel}", flush=True)
        if run.error:
            print(run.error[-3000:], file=sys.stderr)
    print(f"{len(paths) - failed} passed, {failed} failed")
    return failed


def record_notebooks(paths: list[Path], threads: int, max_busy: float, force: bool, timeout: int) -> bool:
    """Re-record `paths` in place at the default scale, one at a time, each with `threads` torch threads; a notebook
    is saved only when other programs used at most `max_busy` cores just before and after it (`force`: always).
    RESULTS.md's times and claims and the README's sample follow when the notebooks are the course's. Returns
    whether all were saved."""
    import torch

    from .measure.calibration import load_calibration
    from .system.device import detect_capabilities
    from .system.scale import current_scale

    caps = detect_capabilities()
    caller_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # the calibration is this machine's at the notebooks' thread count
    try:
        calibration = load_calibration()  # the one every notebook divides by (measured now if the cache has none)
    finally:  # the caller's own thread count is its own (a test worker's one thread, say)
        torch.set_num_threads(caller_threads)
    meta = {"machine": caps.name, "device": caps.device_type, "bf16_native": caps.bf16_native,
            "torch": torch.__version__, "threads": threads, "scale": current_scale(caps.device_type),
            "calibration": f"{calibration.key} measured {calibration.measured}"}

    def quiet(when: str) -> bool:
        busy = busy_cores()
        if busy is None:
            print(f"  {when}: cannot read this machine's load (no /proc/stat); not checked")
            return True
        print(f"  {when}: other programs used {busy:.2f} cores (limit {max_busy})", flush=True)
        return busy <= max_busy or force

    print(f"recording {len(paths)} notebook(s) in place, one at a time: {meta}")
    for i, path in enumerate(paths):
        print(f"[{i + 1}/{len(paths)}] {path.parent.name}/{path.name}{remaining_estimate(paths, i)}", flush=True)
        if not quiet("before"):
            print("the machine is busy: stop what else runs, or pass --force to record anyway", file=sys.stderr)
            return False
        date = datetime.datetime.now(datetime.UTC).date().isoformat()
        with tempfile.TemporaryDirectory(dir=path.parent, prefix=".record-") as tmp:  # same disk: an atomic move
            result = execute_notebook(path, Path(tmp) / path.name, smoke=False, timeout=timeout, threads=threads,
                                      metadata={**meta, "recorded": date})
            print(f"  {'FAIL' if result.error else 'ok'} in {result.seconds / 60:.1f} min", flush=True)
            if result.error:
                print(result.error[-3000:], file=sys.stderr)
                return False
            if not quiet("after"):
                print(f"the machine got busy while {path.name} ran: its outputs are not saved; record it again "
                      "on a quiet machine, or pass --force", file=sys.stderr)
                return False
            os.replace(Path(tmp) / path.name, path)
    if all(p.is_relative_to(ROOT) for p in paths):
        update_recorded()  # RESULTS.md's times and claims and the README's sample are the recording's
    return True


def _run_arguments(parser) -> None:
    which = parser.add_mutually_exclusive_group()
    which.add_argument("notebooks", nargs="*", default=[], help="notebooks to run (default: every chapter's)")
    which.add_argument("--core", action="store_true", help="the core path's notebooks, in order")
    parser.add_argument("--out", default="reports", help="folder for the executed copies (default: reports)")
    parser.add_argument("--smoke", action="store_true", help="smoke scale (same as COURSE_SMOKE=1)")
    parser.add_argument("--timeout", type=positive_int, default=900, help="seconds allowed per cell")


def _run(args) -> int:
    from .system.scale import smoke_requested

    paths = [ROOT / name for name in CORE_PATH] if args.core else [Path(p) for p in args.notebooks] or find_notebooks()
    return 1 if run_notebooks(paths, Path(args.out), args.smoke or smoke_requested(), args.timeout) else 0


def _record_arguments(parser) -> None:
    parser.add_argument("notebooks", nargs="*", help="notebooks to record (default: every chapter's)")
    parser.add_argument("--threads", type=positive_int, help="torch threads in every notebook (default: all cores)")
    parser.add_argument("--max-busy", type=positive_float, default=0.3,
                        help="most cores other programs may use before and after each notebook (default 0.3)")
    parser.add_argument("--force", action="store_true", help="record even on a busy machine")
    parser.add_argument("--timeout", type=positive_int, default=900, help="seconds allowed per cell")


def _record(args) -> int:
    paths = [Path(p).resolve() for p in args.notebooks] or find_notebooks()
    saved = record_notebooks(paths, args.threads or os.cpu_count() or 1, args.max_busy, args.force, args.timeout)
    return 0 if saved else 1


def _sync(args) -> int:
    for path in find_notebooks():
        if sync_bootstrap(path):
            print(f"updated {path}")
    return 0


RUN_COMMAND = Command("run-notebooks", "execute notebooks headless into a report folder", _run_arguments, _run)
RECORD_COMMAND = Command("record", "re-record notebooks in place at the default scale, one at a time, on a quiet "
                         "machine", _record_arguments, _record)
SYNC_COMMAND = Command("sync-bootstrap", "write the bootstrap cell into every notebook", lambda parser: None, _sync)
