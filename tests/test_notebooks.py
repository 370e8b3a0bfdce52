"""Every notebook runs headless at smoke scale, and ships clean: bootstrap cell, outputs, no local paths."""

import json
import re
import sys

import nbformat
import pytest

from helpers import manifest
from helpers.notebooks import (
    BOOTSTRAP_METADATA,
    CORE_PATH,
    DEEP_DIVES,
    ROOT,
    bootstrap_source,
    clean_outputs,
    colab_link,
    execute_notebook,
    find_notebooks,
    is_solutions,
    notebook_label,
    path_line,
    sync_bootstrap,
    terminal_text,
    widget_text,
)
from helpers.system.files import CACHE_ENV

NOTEBOOKS = find_notebooks()
IDS = [str(p.relative_to(ROOT)) for p in NOTEBOOKS]
LOCAL_PATH = re.compile(r"(/home/|/Users/|/root/|/work/|/tmp/|C:\\\\Users)")


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under ch*/"


# ch05/07 and ch06/01 reuse the run ch05/01 finished (Trainer.fit_or_reuse; their manifest entries' `reuses_run_of`).
# Their smoke runs share a cache of their own, on one worker, in the chapters' order, so a change that makes a
# recipe differ from ch05/01's fails that notebook's run.
REUSERS = [n.path for n in manifest.NOTEBOOKS if n.reuses_run_of]
SHARED_RUN = (*dict.fromkeys(n.reuses_run_of for n in manifest.NOTEBOOKS if n.reuses_run_of), *REUSERS)
REUSED = "finished run, loaded from the course's cache"


@pytest.fixture(scope="session")
def shared_run_cache(tmp_path_factory):
    return {"directory": tmp_path_factory.mktemp("course-cache"), "trained": False}


def smoke_param(path):
    shared = str(path.relative_to(ROOT)) in SHARED_RUN
    return pytest.param(path, marks=[pytest.mark.xdist_group("shared-run")] if shared else [])


@pytest.mark.parametrize("path", [smoke_param(p) for p in NOTEBOOKS], ids=IDS)
def test_notebook_runs_at_smoke_scale(path, tmp_path, monkeypatch, request):
    """Every notebook runs; one whose DEVICE is the CPU here runs with it on a virtual second device, so a tensor,
    cache or generator left on the CPU fails here as it would on a GPU."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # run as a learner would (an old triton's tests set it)
    name = str(path.relative_to(ROOT))
    if name in SHARED_RUN:
        # asked for here, not in the signature: a test naming the module's fixture joins the module's xdist group,
        # and the other notebooks would all run on one worker
        shared_run_cache = request.getfixturevalue("shared_run_cache")
        monkeypatch.setenv(CACHE_ENV, str(shared_run_cache["directory"]))
    virtual = manifest.entry(name).off_virtual_device is None  # the entry says why not
    run = execute_notebook(path, tmp_path / path.name, smoke=True, timeout=300, virtual_device=virtual)
    assert run.error is None, run.error[-4000:]
    if name == SHARED_RUN[0]:
        shared_run_cache["trained"] = True
    elif name in REUSERS and shared_run_cache["trained"]:
        cells = nbformat.read(tmp_path / path.name, as_version=4).cells
        assert any(REUSED in o.get("text", "") for c in cells for o in c.get("outputs", [])), (
            f"{name} trained again the run {SHARED_RUN[0]} had finished: their recipes differ")


def test_a_notebook_that_leaves_a_tensor_on_the_cpu_fails_on_the_virtual_device(tmp_path):
    """ch06/04 passed a CPU generator to torch.multinomial over probabilities on DEVICE; ch06/06 fed validation
    windows on the CPU to a model on DEVICE. Both ran on a CPU and crashed on a GPU."""
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("import helpers\nimport torch"),
                nbformat.v4.new_code_cell('DEVICE = helpers.detect_capabilities().device_type', metadata={
                    "tags": ["parameters"]}),
                nbformat.v4.new_code_cell("probs = torch.tensor([0.5, 0.5], device=DEVICE)\n"
                                          "torch.multinomial(probs, 1, generator=torch.Generator(DEVICE))"),
                nbformat.v4.new_code_cell("torch.multinomial(probs, 1, generator=torch.Generator())")]
    path = tmp_path / "placement.ipynb"
    nbformat.write(nb, path)
    assert execute_notebook(path, smoke=True, timeout=120).error is None  # on the plain CPU nothing is wrong
    run = execute_notebook(path, smoke=True, timeout=120, virtual_device=True)
    assert "PlacementError" in run.error and "generator made for the CPU" in run.error
    assert "probs = torch.tensor" not in run.error  # the cell that stopped is the last, not the one before it


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_clean(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source == bootstrap_source(), "run `python -m helpers sync-bootstrap`"
    assert code[0].metadata.items() >= BOOTSTRAP_METADATA.items(), "run `python -m helpers sync-bootstrap`"
    assert colab_link(path) in nb.cells[0].source.split("\n"), "run `python -m helpers sync-bootstrap`"
    on_path = path_line(path)
    assert on_path is None or on_path in nb.cells[0].source.split("\n"), "run `python -m helpers sync-bootstrap`"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert params == [code[1]], "the second code cell must be the only one tagged `parameters`"
    assert all(c.execution_count is not None for c in code), "commit the notebook with its outputs"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "outputs of one top-to-bottom run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert not LOCAL_PATH.search(json.dumps(nb)), "a path of the author's machine is in the notebook"
    # only the final state of each progress bar: no redraws, no widgets (they show as nothing outside Jupyter)
    assert "widgets" not in nb.metadata
    for cell in code:
        assert not any("application/vnd.jupyter.widget-view+json" in o.get("data", {}) for o in cell.outputs)
        streams = [o for o in cell.outputs if o.output_type == "stream"]
        assert not any("\r" in o.text for o in streams), "progress-bar redraws saved: helpers.notebooks.clean_outputs"
        pairs = zip(cell.outputs, cell.outputs[1:], strict=False)
        assert not any(a.output_type == b.output_type == "stream" and a.name == b.name for a, b in pairs)


def shown_value(cell) -> str | None:
    """What Jupyter shows below a code cell as its value: the call of its last statement, if it is a bare call."""
    import ast

    if cell.source.startswith("%%"):  # a cell magic (%%writefile): not Python, shows no value
        return None
    body = ast.parse(cell.source).body
    if body and isinstance(body[-1], ast.Expr) and isinstance(body[-1].value, ast.Call):
        return ast.unparse(body[-1].value.func)
    return None


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_an_exercise_check_prints_its_verdict_and_shows_no_bare_bool(path):
    """A check returns True or False for the tests; in a notebook its printed line is the verdict, and a bare
    `False` under a starter cell reads as an error."""
    code = [c for c in nbformat.read(path, as_version=4).cells if c.cell_type == "code"]
    shown = [name for c in code if (name := shown_value(c)) and name.split(".")[-1].startswith("check_")]
    assert not shown, f"assign the result of {shown} (`_ = check_...(...)`): Jupyter shows it as a bare True/False"
    bools = [o for c in code for o in c.outputs
             if o.output_type == "execute_result" and o.get("data", {}).get("text/plain") in ("True", "False")]
    assert not bools, f"{len(bools)} cells record a bare True/False: run `helpers record` after the fix above"


def test_terminal_text_keeps_the_last_redraw_of_each_line():
    assert terminal_text("\rbar 0%\rbar 50%\rbar 100%\nnext\n") == "bar 100%\nnext\n"
    assert terminal_text("a\r\nb") == "a\nb"  # a bare carriage return at the end erases nothing


def test_clean_outputs_keeps_what_a_reader_needs_from_the_streams():
    """Redraws collapsed, widget bars read as text, finished bars and emptied streams dropped, a warning and a bar
    that stopped early kept, and the streams on either side of a dropped one merged."""
    nb = nbformat.v4.new_notebook()
    widget = {"model_id": "box", "version_major": 2, "version_minor": 0}
    nb.cells = [nbformat.v4.new_code_cell("run()", outputs=[
        nbformat.v4.new_output("stream", name="stderr", text="\rtrain: 0%"),
        nbformat.v4.new_output("stream", name="stderr", text="\rtrain: 100%|##| 4/4 [00:01<00:00, loss=2.1]\n"),
        nbformat.v4.new_output("stream", name="stdout", text="done\n"),
        nbformat.v4.new_output("display_data", data={"application/vnd.jupyter.widget-view+json": widget,
                                                     "text/plain": "load: 0%"}),
        nbformat.v4.new_output("stream", name="stdout", text="then\n"),
        nbformat.v4.new_output("stream", name="stderr", text="UserWarning: look\n\rsweep: 50% 1/2\n"),
    ])]
    state = {"box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_p", "IPY_MODEL_r"]}},
             "l": {"model_name": "HTMLModel", "state": {"value": "load:\u2007100%"}},
             "p": {"model_name": "FloatProgressModel", "state": {"value": 3.0, "max": 3.0}},
             "r": {"model_name": "HTMLModel", "state": {"value": "\u20073/3\u2007[00:01&lt;00:00]"}}}
    nb.metadata["widgets"] = {"application/vnd.jupyter.widget-state+json": {"state": state}}
    outputs = clean_outputs(nb).cells[0].outputs
    assert [(o.name, o.text) for o in outputs] == [("stdout", "done\nthen\n"),
                                                   ("stderr", "UserWarning: look\nsweep: 50% 1/2\n")]
    assert "widgets" not in nb.metadata


def test_a_bar_redrawn_between_a_loops_prints_is_dropped_once_finished():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("for mode in tqdm(modes): print(table(mode))", outputs=[
        nbformat.v4.new_output("stream", name="stderr", text="modes:   0%|          | 0/2 [00:00<?, ?it/s]"),
        nbformat.v4.new_output("stream", name="stdout", text="fwd table\n"),
        nbformat.v4.new_output("stream", name="stderr", text="\rmodes:  50%|#####     | 1/2 [00:01<00:01]"),
        nbformat.v4.new_output("stream", name="stdout", text="fwdbwd table\n"),
        nbformat.v4.new_output("stream", name="stderr", text="\rmodes: 100%|##########| 2/2 [00:02<00:00]\n"),
    ])]
    assert [(o.name, o.text) for o in clean_outputs(nb).cells[0].outputs] == [("stdout", "fwd table\nfwdbwd table\n")]


def test_a_widget_bar_is_read_as_its_final_text():
    state = {"box": {"model_name": "HBoxModel", "state": {"children": ["IPY_MODEL_l", "IPY_MODEL_r"]}},
             "l": {"model_name": "HTMLModel", "state": {"value": "load:\u2007100%"}},
             "r": {"model_name": "HTMLModel", "state": {"value": "\u20073/3\u2007[00:01&lt;00:00]"}}}
    assert widget_text({"model_id": "box"}, state) == "load: 100% 3/3 [00:01<00:00]"


def test_the_readme_links_every_lesson_to_colab():
    readme = (ROOT / "README.md").read_text()
    urls = {p.name: colab_link(p).split("](")[1][:-1] for p in NOTEBOOKS if p.name != "solutions.ipynb"}
    missing = [name for name, url in urls.items() if url not in readme]
    assert not missing, f"the README's chapters table lacks a Colab link for {missing}"


def test_every_lesson_is_on_the_core_path_or_a_deep_dive_after_the_core_notebook_it_extends():
    lessons = [p.relative_to(ROOT).as_posix() for p in NOTEBOOKS if not is_solutions(p)]
    assert sorted(CORE_PATH) == list(CORE_PATH), "the core path follows the chapters' order"
    assert not set(CORE_PATH) & set(DEEP_DIVES)
    assert sorted([*CORE_PATH, *DEEP_DIVES]) == lessons
    assert all(core in CORE_PATH and core < dive for dive, core in DEEP_DIVES.items())


def test_a_lessons_title_says_where_it_stands_on_the_path_with_links_that_resolve():
    assert path_line(ROOT / "ch04_flops/01_gpt_model.ipynb") == (
        "**Core path, 4 of 8.** After [3.1 Self-attention from scratch](../ch03_attention/01_self_attention.ipynb); "
        "next: [5.1 Pretraining the GPT](../ch05_training/01_pretraining.ipynb). Deep dives from here: "
        "[4.2](02_flops_analysis.ipynb), [4.3](03_activation_functions.ipynb).")
    assert path_line(ROOT / "ch02_text/01_tokenization.ipynb").startswith("**Core path, 1 of 8.** Start here; next:")
    assert path_line(ROOT / "ch07_parallel/04_fsdp.ipynb") == (
        "**Deep dive**, extending the core path's [5.1 Pretraining the GPT](../ch05_training/01_pretraining.ipynb).")
    assert path_line(ROOT / "ch07_parallel/solutions.ipynb") is None
    for path in NOTEBOOKS:
        for target in re.findall(r"\]\(([^)]+\.ipynb)\)", path_line(path) or ""):
            assert (path.parent / target).resolve().is_file(), f"{path.name}: {target}"


def test_the_readme_lists_the_core_path_in_order():
    readme = (ROOT / "README.md").read_text()
    steps = [f"{i}. [{notebook_label(name)}]({name})" for i, name in enumerate(CORE_PATH, 1)]
    found = [readme.find(step) for step in steps]
    assert -1 not in found and found == sorted(found), [s for s, f in zip(steps, found, strict=True) if f == -1]


def test_sync_bootstrap_inserts_updates_and_is_idempotent(tmp_path):
    path = tmp_path / "lesson.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell("1")])
    nbformat.write(nb, path)
    assert sync_bootstrap(path, url="https://github.com/a/course", root=tmp_path)
    cells = nbformat.read(path, as_version=4).cells
    assert [c.cell_type for c in cells] == ["markdown", "code", "code"]
    assert 'REPOSITORY_URL = "https://github.com/a/course"' in cells[1].source
    link = "[Open in Colab](https://colab.research.google.com/github/a/course/blob/main/lesson.ipynb)"
    assert cells[0].source == f"# Title\n\n{link}"
    assert not sync_bootstrap(path, url="https://github.com/a/course", root=tmp_path)
    assert sync_bootstrap(path, url="https://github.com/fork/course", root=tmp_path)
    cells = nbformat.read(path, as_version=4).cells
    assert len(cells) == 3 and 'REPOSITORY_URL = "https://github.com/fork/course"' in cells[1].source
    assert cells[0].source.count("Open in Colab") == 1 and "github/fork/course/blob" in cells[0].source


@pytest.fixture
def run_bootstrap(python_process):
    """The bootstrap cell as a script, in a folder (on Colab: /content)."""
    import os

    def run(cwd, url="https://example.invalid/course", env=None):
        return python_process("-c", bootstrap_source(url), cwd=cwd, env={**os.environ, **(env or {})})

    return run


def test_bootstrap_outside_a_clone_without_network_says_what_to_do(run_bootstrap, tmp_path):
    """A fresh runtime that cannot reach the repository: one message with the reason and what to do, no
    traceback, and nothing half-installed."""
    done = run_bootstrap(tmp_path, url=str(tmp_path / "no-such-repository"))
    assert done.returncode == 1 and "Traceback" not in done.stderr
    first, advice = done.stderr.strip().splitlines()[-2:]
    assert first.startswith("setup failed at `git clone`: fatal:") and "no-such-repository" in first
    assert advice.startswith("Check that this runtime reaches the internet, or clone")
    assert not (tmp_path / "gpt-from-scratch-fast" / "helpers").exists()


def test_bootstrap_inside_a_clone_uses_the_clone_as_it_is(run_bootstrap, tmp_path):
    """In a notebook's folder of a clone: nothing is installed or cloned, the clone's helpers are imported even when
    a stray helpers.py sits in the working folder or an installed `helpers` points elsewhere."""
    done = run_bootstrap(ROOT / "ch02_text")
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("torch ") and not (ROOT / "ch02_text" / "gpt-from-scratch-fast").exists()
    # a fresh runtime whose earlier run already cloned the course: the clone wins over a stray helpers.py
    (tmp_path / "helpers.py").write_text("raise RuntimeError('the stray module was imported')\n")
    (tmp_path / "gpt-from-scratch-fast").symlink_to(ROOT, target_is_directory=True)
    done = run_bootstrap(tmp_path)
    assert done.returncode == 0 and "stray" not in done.stderr, done.stderr


@pytest.fixture
def bootstrap_module():
    """setup/bootstrap.py, which the first cell runs, as a module."""
    import runpy

    return runpy.run_path(str(ROOT / "setup" / "bootstrap.py"))


def test_bootstrap_shows_pips_progress_and_says_why_an_install_failed(bootstrap_module, capsys):
    run_pip = bootstrap_module["run_pip"]
    script = "print('Collecting tiktoken'); print('  Downloading 1 MB'); print('Successfully installed tiktoken-0.12')"
    run_pip([sys.executable, "-c", script])
    shown = capsys.readouterr().out
    assert "  Collecting tiktoken\n" in shown and "  Successfully installed tiktoken-0.12\n" in shown
    assert "Downloading" not in shown
    with pytest.raises(SystemExit, match="setup failed at `pip install`: ERROR: no matching distribution"):
        run_pip([sys.executable, "-c", "import sys; print('Collecting x'); print('ERROR: no matching distribution');"
                 "sys.exit(1)"])
    with pytest.raises(SystemExit, match="did not finish within 1 s"):
        run_pip([sys.executable, "-c", "import time; time.sleep(60)"], timeout_s=1)


def test_bootstrap_installs_only_the_clone_the_first_cell_made(bootstrap_module, tmp_path, monkeypatch):
    calls = []
    course_helpers = bootstrap_module["course_helpers"]
    monkeypatch.setitem(course_helpers.__globals__, "run_pip", calls.append)
    monkeypatch.setitem(course_helpers.__globals__, "is_installed", lambda: False)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", list(sys.path))  # course_helpers puts the course first
    with pytest.raises(SystemExit, match="restart the kernel"):  # not a course: its helpers come from elsewhere
        course_helpers(tmp_path / "gpt-from-scratch-fast")
    assert calls and calls[0][-2:] == ["--editable", str(tmp_path / "gpt-from-scratch-fast")]
    calls.clear()
    assert course_helpers(ROOT).__file__ == str(ROOT / "helpers" / "__init__.py") and not calls  # yours: as it is


def write_notebook(path, *sources):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
    return path


@pytest.mark.parametrize("cell, message", [
    ("import time\ntime.sleep(30)", "code cell 2 ('import time') timed out after 2 s"),
    ("import os\nos._exit(1)", "kernel died (out of host memory?) in code cell 2 ('import os')"),
    ("import os, signal, time\nos.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(30)",  # as the OOM killer does
     "kernel died (out of host memory?) in code cell 2 ('import os, signal, time')"),
], ids=["timeout", "dead-kernel", "killed-kernel"])
def test_run_notebooks_records_a_stuck_or_dead_notebook_and_runs_the_next(tmp_path, capsys, cell, message):
    """`make course` must not stop at a cell past --timeout or a kernel the host's OOM killer ended: that notebook
    fails with a message naming the cell, its outputs so far are saved, and the next notebook runs."""
    from helpers.__main__ import main

    bad = write_notebook(tmp_path / "bad.ipynb", "print('before')", cell, "print('never')")
    good = write_notebook(tmp_path / "good.ipynb", "print('ran')")
    status = main(["run-notebooks", str(bad), str(good), "--out", str(tmp_path / "out"), "--timeout", "2"])
    out, err = capsys.readouterr()
    assert status == 1 and "1 passed, 1 failed" in out and message in err
    saved = {p.name: nbformat.read(p, as_version=4) for p in (tmp_path / "out").glob("*.ipynb")}
    assert saved["bad.ipynb"].cells[0].outputs[0].text == "before\n"
    assert saved["good.ipynb"].cells[0].outputs[0].text == "ran\n"


def test_run_notebooks_signalled_mid_notebook_records_it_and_runs_the_next(tmp_path, python_process):
    """A SIGTERM (or Ctrl-C) to run-notebooks makes nbclient shut the kernel down, and nbclient's own clean-up then
    failed with a bare AssertionError that ended the whole run; the notebook is now recorded as stopped, with its
    outputs so far, and the next one runs. The cell signals its parent, the runner."""
    bad = write_notebook(tmp_path / "bad.ipynb", "print('before')",
                         "import os, signal, time\nos.kill(os.getppid(), signal.SIGTERM)\ntime.sleep(600)",
                         "print('never')")
    good = write_notebook(tmp_path / "good.ipynb", "print('ran')")
    done = python_process("-m", "helpers", "run-notebooks", bad, good, "--out", tmp_path / "out", cwd=ROOT,
                          timeout=600)
    assert done.returncode == 1 and "1 passed, 1 failed" in done.stdout, done.stdout + done.stderr[-3000:]
    assert "the kernel was shut down in code cell 2 ('import os, signal, time')" in done.stderr
    saved = {p.name: nbformat.read(p, as_version=4) for p in (tmp_path / "out").glob("*.ipynb")}
    assert saved["bad.ipynb"].cells[0].outputs[0].text == "before\n"
    assert saved["good.ipynb"].cells[0].outputs[0].text == "ran\n"


@pytest.mark.subprocess  # a Jupyter kernel
def test_a_notebook_run_prints_nothing_of_its_kernel(tmp_path, capfd):
    """`make course` shows each notebook's line and nothing of the kernel: over TCP, ipykernel warned that its
    channel is unencrypted, once per notebook; the kernel now talks over Unix domain sockets."""
    run = execute_notebook(write_notebook(tmp_path / "quiet.ipynb", "print('ran')"), smoke=True, timeout=60)
    assert run.error is None
    out, err = capfd.readouterr()
    assert "WARNING" not in err and "encryption" not in err, err
