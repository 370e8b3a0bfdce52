"""Recording notebooks: the metadata each recording leaves, the refusal of a busy machine, and the estimate of
the time left that `make course` prints."""

import json
import types

import nbformat
import pytest

from helpers import __main__ as cli
from helpers import notebooks
from helpers.measure import calibration


@pytest.fixture(autouse=True)
def cached_calibration(monkeypatch):
    """This machine's calibration as the cache holds it: recording names it, and measuring one takes a minute."""
    cached = types.SimpleNamespace(key="0123456789abcdef", measured="2026-12-01")
    monkeypatch.setattr(calibration, "load_calibration", lambda *a, **k: cached)
    return cached


def tiny_notebook(path, source="print(6 * 7)"):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(source)]
    nbformat.write(nb, path)
    return path


def test_record_writes_outputs_and_metadata_in_place(tmp_path, monkeypatch, cached_calibration):
    monkeypatch.delenv("COURSE_SMOKE", raising=False)  # recorded at the default scale, whatever the shell asks
    path = tiny_notebook(tmp_path / "a.ipynb", "import os\nprint(os.environ['OMP_NUM_THREADS'], 6 * 7)")
    monkeypatch.setattr(notebooks, "busy_cores", lambda seconds=3.0: 0.0)
    assert cli.main(["record", str(path), "--threads", "1"]) == 0
    nb = json.loads(path.read_text())
    assert "".join(nb["cells"][0]["outputs"][0]["text"]) == "1 42\n"  # the thread count pinned for the kernel
    meta = nb["metadata"]["course"]
    assert meta["threads"] == 1 and meta["scale"] in ("cpu", "gpu") and meta["wall_seconds"] > 0
    assert {"machine", "device", "torch", "recorded"} <= set(meta)
    assert meta["calibration"] == "0123456789abcdef measured 2026-12-01"  # the peaks its outputs divide by
    assert notebooks.recorded_seconds(path) == meta["wall_seconds"]
    assert not list(tmp_path.glob(".record-*"))  # no temporary folder left behind


@pytest.mark.parametrize("busy_after", [False, True])
def test_a_busy_machine_is_refused(tmp_path, monkeypatch, capsys, busy_after):
    path = tiny_notebook(tmp_path / "a.ipynb")
    before = path.read_text()
    readings = iter([0.0, 1.5] if busy_after else [1.5])
    monkeypatch.setattr(notebooks, "busy_cores", lambda seconds=3.0: next(readings))
    assert cli.main(["record", str(path)]) == 1
    assert path.read_text() == before  # nothing written
    assert ("got busy while" if busy_after else "the machine is busy") in capsys.readouterr().err


def test_force_records_on_a_busy_machine(tmp_path, monkeypatch):
    path = tiny_notebook(tmp_path / "a.ipynb")
    monkeypatch.setattr(notebooks, "busy_cores", lambda seconds=3.0: 1.5)
    assert cli.main(["record", str(path), "--force"]) == 0
    assert "course" in json.loads(path.read_text())["metadata"]


def test_busy_cores_measures_this_machine():
    busy = notebooks.busy_cores(0.2)
    assert busy is None or 0 <= busy


def test_remaining_estimate_sums_the_recorded_times(tmp_path):
    paths = [tiny_notebook(tmp_path / f"{i}.ipynb") for i in range(3)]
    for path, seconds in zip(paths, (60, 120, 180), strict=True):
        nb = nbformat.read(path, as_version=4)
        nb.metadata["course"] = {"wall_seconds": seconds}
        nbformat.write(nb, path)
    assert notebooks.remaining_estimate(paths, 1) == "; about 5 min left by the recorded times"
    assert notebooks.remaining_estimate(paths, 3) == ""
    assert notebooks.remaining_estimate([*paths, tiny_notebook(tmp_path / "new.ipynb")], 0) == ""


def test_recorded_times_claims_and_sample(tmp_path):
    paths = [tiny_notebook(tmp_path / f"{i}.ipynb") for i in range(2)]
    nb = nbformat.read(paths[0], as_version=4)
    nb.metadata["course"] = {"wall_seconds": 90.0, "machine": "Test CPU", "device": "cpu", "bf16_native": False,
                             "threads": 2, "torch": "2.13.0", "calibration": "0123 measured 2026-11-30",
                             "recorded": "2026-12-01"}
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text="✓ A beats B: 2.0x\nother\n"),
                           nbformat.v4.new_output("stream", name="stderr",
                                                  text="✗ C | D: 0.9x  <- does not hold on this machine\n")]
    nbformat.write(nb, paths[0])
    core = tmp_path / notebooks.CORE_PATH[1]  # a core notebook's minutes count for `make core` too
    core.parent.mkdir(parents=True)
    nb.cells.append(nbformat.v4.new_markdown_cell("word " * 2600))
    nbformat.write(nb, core)
    nb.cells.pop()
    front = notebooks.front_door([core, *paths], root=tmp_path)
    assert (f"the {len(notebooks.CORE_PATH)} notebooks of the core path compute for 2 minutes and all the lessons for "
            "3 (recorded on Test CPU, 2 threads); their prose is about 3,000 words on the core path (about 15 "
            "minutes of reading at 200 words a minute) and 3,000 in all") in front
    core_times = notebooks.recorded_times_table([core, *paths], root=tmp_path).splitlines()[-4:]
    assert core_times[:2] == ["| core path (`make core`) | 2 | | | | | |", "| lessons (`make course`) | 3 | | | | | |"]
    times = notebooks.recorded_times_table(paths, root=tmp_path)
    assert "| `0.ipynb` | 1.5 | Test CPU (cpu) | 2 | 2.13.0 | 0123 measured 2026-11-30 | 2026-12-01 |" in times
    assert "| `1.ipynb` | not recorded |" in times
    assert times.splitlines()[-4:] == ["| core path (`make core`) | 0 | | | | | |",
                                       "| lessons (`make course`) | 2 | | | | | |",
                                       "| solutions (`make solutions`) | 0 | | | | | |", "| all | 2 | | | | | |"]
    assert notebooks.notebook_claims(paths[0]) == [(True, "✓ A beats B: 2.0x"), (False, "✗ C | D: 0.9x")]
    claims = notebooks.claims_table(paths, root=tmp_path)
    assert claims.splitlines()[2:] == ["| `0.ipynb` | ✓ A beats B: 2.0x |", "| `0.ipynb` | ✗ C / D: 0.9x |"]
    (_, t0, t1), (_, c0, c1) = notebooks.RECORDED_SECTIONS["times"], notebooks.RECORDED_SECTIONS["claims"]
    _, s0, s1 = notebooks.RECORDED_SECTIONS["sample"]
    _, f0, f1 = notebooks.RECORDED_SECTIONS["front"]
    sample_path = tmp_path / notebooks.SAMPLE_NOTEBOOK
    sample_path.parent.mkdir(parents=True)
    nb = nbformat.read(tiny_notebook(sample_path), as_version=4)
    nb.cells[0].metadata["tags"] = [notebooks.SAMPLE_TAG]
    nb.cells[0].outputs = [nbformat.v4.new_output("stream", name="stdout", text=(
        " step  sample (prompt: 'def f')\n    0  '\\x00 noise'\n   20  '(x):\\n    return x'\n"))]
    nbformat.write(nb, sample_path)
    sample = notebooks.readme_sample(sample_path, root=tmp_path)
    assert sample.startswith("```text\ndef f(x):\n    return x\n```\n") and "after 20 training steps" in sample
    (tmp_path / "RESULTS.md").write_text(f"intro\n{t0}\nold\n{t1}\nmiddle\n{c0}\n{c1}\nrest\n")
    (tmp_path / "README.md").write_text(f"top\n{f0}\n{f1}\n{s0}\n{s1}\n")
    assert notebooks.update_recorded(paths, root=tmp_path) == ["RESULTS.md", "README.md"]
    assert (tmp_path / "RESULTS.md").read_text() == f"intro\n{t0}\n{times}\n{t1}\nmiddle\n{c0}\n{claims}\n{c1}\nrest\n"
    front = notebooks.front_door(paths, root=tmp_path)
    assert (tmp_path / "README.md").read_text() == f"top\n{f0}\n{front}\n{f1}\n{s0}\n{sample}\n{s1}\n"
    assert notebooks.update_recorded(paths, root=tmp_path) == []
    (tmp_path / "RESULTS.md").write_text(f"{t0}\n{t1}\n")
    with pytest.raises(ValueError, match="no claims markers"):
        notebooks.update_recorded(paths, root=tmp_path)
    nb.cells[0].metadata["tags"] = []
    nbformat.write(nb, sample_path)
    with pytest.raises(ValueError, match="no cell tagged 'readme-sample'"):
        notebooks.readme_sample(sample_path, root=tmp_path)


def test_results_and_readme_show_the_committed_recording():
    for key, content in notebooks.recorded_contents().items():
        document, start, end = notebooks.RECORDED_SECTIONS[key]
        committed = (notebooks.ROOT / document).read_text().split(start, 1)[1].split(end, 1)[0]
        assert committed == f"\n{content}\n", f"{document}'s {key} differ from the notebooks: run `helpers record`"


def test_every_notebook_records_its_machine_and_time():
    recordings = {}
    for path in notebooks.find_notebooks():
        meta = nbformat.read(path, as_version=4).metadata.get("course")
        assert meta and meta["wall_seconds"] > 0 and meta["recorded"], f"{path} was not recorded with `make record`"
        recordings.setdefault(tuple(meta.get(k) for k in ("machine", "torch", "threads", "calibration")), []).append(
            path.name)
    assert len(recordings) == 1, f"record every notebook on one machine, with one calibration: {recordings}"
