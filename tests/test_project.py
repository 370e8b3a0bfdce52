"""Packaging: what the README promises about installing stays true."""

import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    tomllib = pytest.importorskip("tomli")


def requirement_lines(text: str) -> dict[str, str]:
    found = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, spec = re.match(r"([A-Za-z0-9._-]+)(.*)", line).groups()
            found[name.lower()] = spec.strip()
    return found


def test_package_dependencies_match_requirements_txt():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pinned = requirement_lines((ROOT / "requirements.txt").read_text())
    for dep in deps:
        name, spec = re.match(r"([A-Za-z0-9._-]+)(.*)", dep).groups()
        assert pinned.get(name.lower()) == spec, f"{dep} differs from requirements.txt"


def test_helpers_import_from_anywhere(python_process, tmp_path):
    out = python_process("-c", "import helpers; print(helpers.GPT.__name__)", cwd=tmp_path, check=True)
    assert out.stdout.strip() == "GPT"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in readme and re.search(r"^\s*make test\b", ci, re.M)


def load_matrix():
    import importlib.util

    spec = importlib.util.spec_from_file_location("matrix", ROOT / ".ci" / "matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_ci_runs_the_unit_tests_on_the_oldest_and_the_newest_torch():
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^python3 \.ci/matrix\.py lowest --discard$", ci, re.M)
    assert re.search(r"^python3 \.ci/matrix\.py newest --discard$", ci, re.M)


@pytest.mark.parametrize("argv", [[], ["oldest"], ["lowest", "--keep"], ["newest", "--discard", "extra"]])
def test_the_matrix_exits_2_on_a_usage_error(argv, capsys):
    assert load_matrix().main(argv) == 2
    assert capsys.readouterr().err.startswith("usage: python3 .ci/matrix.py {lowest,newest} [--discard]")


def test_a_leg_the_disk_cannot_hold_is_skipped_before_it_installs_and_says_why(tmp_path, monkeypatch, capsys):
    matrix = load_matrix()
    monkeypatch.setattr(matrix, "ROOT", tmp_path)
    monkeypatch.setattr(matrix, "MAIN_PYTHON", tmp_path / "no-main-environment")
    monkeypatch.setattr(matrix, "DISK_NEEDED_GB", {"lowest": 10**9, "newest": 0})
    (tmp_path / ".venv-lowest").mkdir()  # exists: no venv is created
    (tmp_path / "requirements.txt").write_text("torch>=2.8\n")
    (tmp_path / "pyproject.toml").write_text('[project.optional-dependencies]\ndev = ["pytest>=8"]\n')
    installs = []
    monkeypatch.setattr(matrix, "run", installs.append)
    assert matrix.main(["lowest", "--discard"]) == 0
    assert installs == [] and "lowest: SKIPPED" in capsys.readouterr().err
    assert (tmp_path / ".venv-lowest").exists()  # nothing ran, nothing to discard
    assert matrix.leg_versions("lowest", "", [], tmp_path / ".venv-lowest") == {"torch": "2.8", "pytest": "8"}
    assert matrix.disk_shortfall("newest") is None


def test_discard_removes_the_environment_even_when_its_tests_fail(tmp_path, monkeypatch):
    matrix = load_matrix()
    monkeypatch.setattr(matrix, "ROOT", tmp_path)
    monkeypatch.setattr(matrix, "MAIN_PYTHON", tmp_path / "no-main-environment")
    monkeypatch.setattr(matrix, "DISK_NEEDED_GB", {"lowest": 0, "newest": 0})
    (tmp_path / ".venv-lowest").mkdir()
    (tmp_path / "requirements.txt").write_text("torch>=2.8\n")
    (tmp_path / "pyproject.toml").write_text('[project.optional-dependencies]\ndev = []\n')

    def failing_leg(*args):
        raise subprocess.CalledProcessError(1, ["pytest"])

    monkeypatch.setattr(matrix, "install_and_test", failing_leg)
    with pytest.raises(subprocess.CalledProcessError):
        matrix.main(["lowest", "--discard"])
    assert not (tmp_path / ".venv-lowest").exists()


def test_the_lowest_environment_pins_every_declared_lower_bound():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = project["dependencies"] + project["optional-dependencies"]["dev"]
    pins = load_matrix().lower_bounds(requirements)
    for requirement in requirements:
        name, bound = re.match(r"([A-Za-z0-9._-]+)>=([^;,\s]+)", requirement).groups()
        marker = requirement.partition(";")[2].strip()
        assert f"{name}=={bound}" + (f"; {marker}" if marker else "") in pins, requirement
    assert load_matrix().lower_bounds(["torch>=2.8", "numpy", "x>=1,<2", "y<3"]) == ["torch==2.8", "x==1"]


@pytest.mark.subprocess
def test_make_lab_installs_what_the_notebooks_need_and_make_test_adds_the_development_tools(tmp_path):
    """`make -n` prints what a target would run in a fresh `.venv` (here a folder that does not exist)."""
    def planned(target: str) -> str:
        done = subprocess.run(["make", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        return done.stdout

    lab, test = planned("lab"), planned("test")
    assert "-r requirements.txt -e .\n" in lab and "[dev]" not in lab and "jupyter lab" in lab
    assert "-r requirements.txt -e .\n" in test and '-e ".[dev]"' in test and "pytest" in test


@pytest.mark.subprocess
def test_make_lab_takes_torchs_cpu_build_on_linux_without_an_nvidia_driver(tmp_path):
    """Without `nvidia-smi` on the PATH (Linux), the environment gets torch from PyTorch's CPU index before the
    requirements, unless it has torch already; with one, pip's own choice stands."""
    gpu_bin = tmp_path / "gpu-bin"
    gpu_bin.mkdir()
    (gpu_bin / "nvidia-smi").write_text("#!/bin/sh\n")
    (gpu_bin / "nvidia-smi").chmod(0o755)
    system_path = os.environ["PATH"].split(os.pathsep)
    without = os.pathsep.join(p for p in system_path if not (Path(p) / "nvidia-smi").exists())

    def planned(path: str) -> str:
        done = subprocess.run(["make", "-n", "lab", f"VENV={tmp_path / 'venv'}"], cwd=ROOT, capture_output=True,
                              text=True, timeout=60, env={**os.environ, "PATH": path})
        assert done.returncode == 0, done.stderr
        return done.stdout

    cpu, gpu = planned(without), planned(os.pathsep.join([str(gpu_bin), without]))
    if platform.system() == "Linux":
        assert "--index-url" in cpu and "download.pytorch.org/whl/cpu" in cpu and "import torch" in cpu
        assert cpu.index("whl/cpu") < cpu.index("-r requirements.txt")  # before the requirements take torch
    assert "--index-url" not in gpu and "-r requirements.txt -e ." in gpu


SHARED_FIXTURE_TESTS = '''import os
import pathlib

import pytest


@pytest.fixture(scope="module")
def launch():  # as a torchrun launch: computed once per worker that runs a test using it
    return os.environ["PYTEST_XDIST_WORKER"]


@pytest.mark.parametrize("i", range(6))
def test_shared(launch, i, tmp_path_factory):
    (tmp_path_factory.getbasetemp().parent.parent / f"shared-{i}").write_text(launch)


@pytest.mark.parametrize("i", range(6))
def test_alone(i):
    pass
'''


@pytest.mark.subprocess
def test_tests_sharing_a_module_fixture_run_on_one_worker(tmp_path):
    """make test's --dist loadgroup sends the tests that share a module-scoped result (a torchrun launch, a plan) to
    one worker, from the xdist_group marks tests/conftest.py adds; with pytest 9.2 and pytest-xdist 3.8 the marks were
    ignored, and each worker launched its own."""
    (tmp_path / "conftest.py").write_text(  # the course's collection hook, which adds the marks
        "import importlib.util\n"
        f"spec = importlib.util.spec_from_file_location('course_conftest', {str(ROOT / 'tests/conftest.py')!r})\n"
        "course = importlib.util.module_from_spec(spec)\nspec.loader.exec_module(course)\n"
        "pytest_collection_modifyitems = course.pytest_collection_modifyitems\n")
    (tmp_path / "test_shared_fixture.py").write_text(SHARED_FIXTURE_TESTS)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadgroup", "-p",
                          "no:cacheprovider", f"--basetemp={tmp_path / 'base'}", "test_shared_fixture.py"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    workers = {(tmp_path / f"shared-{i}").read_text() for i in range(6)}
    assert len(workers) == 1, f"the 6 tests sharing one module fixture ran on {sorted(workers)}"
