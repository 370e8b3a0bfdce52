"""helpers.manifest describes every notebook once: a notebook without an entry, or an entry without a field it
needs, fails here with what to add."""

import pytest

from helpers import manifest
from helpers.manifest import NOTEBOOKS, Notebook, entry, unlisted
from helpers.notebooks import ROOT, find_notebooks, is_solutions

NAMES = [path.relative_to(ROOT).as_posix() for path in find_notebooks()]


def test_every_notebook_has_one_entry_in_chapter_order():
    missing = unlisted(NAMES)
    assert not missing, "\n".join(missing)
    assert [notebook.path for notebook in NOTEBOOKS] == NAMES, \
        "list each notebook once, in chapter order, and drop the entries of notebooks that are gone"


def test_a_notebook_without_an_entry_is_named_with_the_fields_to_fill(monkeypatch):
    monkeypatch.delitem(manifest.ENTRIES, "ch05_training/07_decoding.ipynb")
    assert unlisted(NAMES) == ["ch05_training/07_decoding.ipynb has no entry in helpers/manifest.py: add "
                               "Notebook(path=..., role=..., gpu_work=...) in chapter order"]
    with pytest.raises(KeyError, match="07_decoding.ipynb has no entry"):
        entry("ch05_training/07_decoding.ipynb")


def test_an_entry_without_a_field_it_needs_is_refused_naming_the_field():
    with pytest.raises(TypeError, match="'gpu_work'"):
        Notebook(path="ch09_new/01_lesson.ipynb", role="core")
    with pytest.raises(ValueError, match="role 'lesson' is none of"):
        Notebook(path="ch09_new/01_lesson.ipynb", role="lesson", gpu_work="tokenizers run on the CPU")
    with pytest.raises(ValueError, match="a deep dive, and only a deep dive, names the core notebook it extends"):
        Notebook(path="ch09_new/02_dive.ipynb", role="deep dive", gpu_work="tokenizers run on the CPU")


def test_each_entry_agrees_with_its_notebook():
    for notebook in NOTEBOOKS:
        assert (notebook.role == "solutions") == is_solutions(ROOT / notebook.path), notebook.path
        assert callable(notebook.gpu_work) or notebook.gpu_work.strip(), f"{notebook.path}: say why gpu_work is none"
        # the run it reuses comes first: the smoke runs share its cache in path order
        assert notebook.reuses_run_of is None or notebook.reuses_run_of < notebook.path, notebook.path
