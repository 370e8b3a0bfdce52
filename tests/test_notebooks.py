"""Every notebook runs headless at smoke scale, and ships clean: bootstrap cell, outputs, no local paths."""

import json
import re

import nbformat
import pytest

from helpers.notebooks import ROOT, bootstrap_source, execute_notebook, find_notebooks, sync_bootstrap

NOTEBOOKS = find_notebooks()
IDS = [str(p.relative_to(ROOT)) for p in NOTEBOOKS]
LOCAL_PATH = re.compile(r"(/home/|/Users/|/root/|/work/|/tmp/|C:\\\\Users)")


def test_there_are_notebooks():
    assert NOTEBOOKS, "no notebooks found under ch*/"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_runs_at_smoke_scale(path, tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # run as a learner would (conftest sets it for unit tests)
    run = execute_notebook(path, tmp_path / path.name, smoke=True, timeout=300)
    assert run.error is None, run.error[-4000:]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=IDS)
def test_notebook_is_committed_clean(path):
    nb = nbformat.read(path, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code[0].source == bootstrap_source(), "run `python -m helpers sync-bootstrap`"
    params = [c for c in code if "parameters" in c.metadata.get("tags", [])]
    assert params == [code[1]], "the second code cell must be the only one tagged `parameters`"
    assert all(c.execution_count is not None for c in code), "commit the notebook with its outputs"
    assert [c.execution_count for c in code] == list(range(1, len(code) + 1)), "outputs of one top-to-bottom run"
    errors = [o for c in code for o in c.outputs if o.output_type == "error"]
    assert not errors
    assert not LOCAL_PATH.search(json.dumps(nb)), "a path of the author's machine is in the notebook"


def test_sync_bootstrap_inserts_updates_and_is_idempotent(tmp_path):
    path = tmp_path / "lesson.ipynb"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("# Title"), nbformat.v4.new_code_cell("1")])
    nbformat.write(nb, path)
    assert sync_bootstrap(path, url="https://example.org/a")
    cells = nbformat.read(path, as_version=4).cells
    assert [c.cell_type for c in cells] == ["markdown", "code", "code"]
    assert 'REPOSITORY_URL = "https://example.org/a"' in cells[1].source
    assert not sync_bootstrap(path, url="https://example.org/a")
    assert sync_bootstrap(path, url="https://example.org/fork")
    cells = nbformat.read(path, as_version=4).cells
    assert len(cells) == 3 and 'REPOSITORY_URL = "https://example.org/fork"' in cells[1].source


def write_notebook(path, *sources):
    nbformat.write(nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources]), path)
    return path


@pytest.mark.parametrize("cell, message", [
    ("import time\ntime.sleep(30)", "cell 2 ('import time') timed out after 2 s"),
    ("import os\nos._exit(1)", "kernel died (out of host memory?) in cell 2 ('import os')"),
], ids=["timeout", "dead-kernel"])
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
