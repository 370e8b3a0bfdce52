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
