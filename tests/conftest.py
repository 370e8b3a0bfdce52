"""Test tiers, assigned here by rules rather than test by test, and the per-process set-up of a test run.

Markers (registered in pyproject.toml; `--strict-markers` refuses any other):
  notebook      executes a notebook in a Jupyter kernel            (module rule: the notebook runs)
  distributed   launches torchrun workers over gloo                 (fixture rule: `torchrun`)
  subprocess    starts another Python process                       (fixture rule: `python_process`; or marked)
  compile       calls torch.compile                                 (marked on the test)
  slow          the full cross-products behind a representative set (marked on the test)
  serial        measures time or memory of processes: runs alone, after the parallel run (marked on the test)
  versions      can depend on the versions installed: compile, DTensor and pipelining, torchao, transformers,
                FlexAttention, the Triton interpreter, torch's private APIs (module rule below; compile and
                distributed imply it). The lowest- and newest-version CI legs run only these.
  versionless   cannot depend on any library's version: layout, notebook hygiene, bootstrap, README tables,
                CLI parsing (module rule below)

`make test` runs every tier; `make test-fast` the in-process unit tests (no notebook, distributed, subprocess,
compile, slow or serial test).
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

# The suite starts from a known environment, whatever the caller's shell exports: the course's own switches
# (COURSE_SMOKE from `COURSE_SMOKE=1 make course`, COURSE_CACHE_DIR), the hubs' offline and cache settings, and the
# devices, threads and compiler settings torch and its libraries read. Cleared before torch, huggingface_hub or
# transformers is imported (they read some at import) and put back when the run ends; a test that needs one sets it
# itself (monkeypatch.setenv). tests/test_environment.py runs part of the suite with each set to an odd value.
INHERITED = re.compile(r"COURSE_.*|HF_.*|HUGGINGFACE_.*|TRANSFORMERS_.*|TIKTOKEN_.*|TORCH_.*|TORCHINDUCTOR_.*|"
                       r"PYTORCH_.*|TRITON_.*|CUDA_.*|OMP_NUM_THREADS|MKL_NUM_THREADS|TQDM_.*|MPLBACKEND")
CLEARED = {name: os.environ.pop(name) for name in list(os.environ) if INHERITED.fullmatch(name)}

import pytest  # noqa: E402
import torch  # noqa: E402

from helpers.parallel.launch import launch  # noqa: E402

# test module -> markers for every test in it
MODULE_MARKERS = {
    # results that depend on versions of torch or of a peer library
    "test_attention": ("versions",),  # FlexAttention, the Triton interpreter, a dispatch-mode recorder
    "test_checkpointing": ("versions",),  # torch's selective-checkpoint policy, a dispatch-mode counter
    "test_decoding": ("versions",),  # transformers' logits processors
    "test_flash_triton": ("versions",),  # Triton's interpreter and compiler
    "test_flops": ("versions",),  # fvcore, FlopCounterMode, fake tensors
    "test_lm_head": ("versions",),  # a custom autograd Function under autocast; dispatch-mode byte counts
    "test_loading": ("versions",),  # torch.load(mmap=True), safetensors
    "test_memory_plan": ("versions",),  # fake tensors and a dispatch mode (torch's private APIs)
    "test_modern": ("versions",),  # transformers' Llama and Qwen3
    "test_quantization": ("versions",),  # torchao, torch._int_mm
    "test_step": ("versions",),  # torch.compile, transformers' loss
    "test_train_bench": ("versions",),  # torch.compile, transformers' GPT-2 as the peer
    "test_virtual_device": ("versions",),  # dispatch and function modes, wrapper subclasses, swapped parameters
    "test_weights": ("versions",),  # transformers' GPT2LMHeadModel
    "test_moe": ("versions",),  # torch._grouped_mm where it exists, FlopCounterMode, torch.compile
    "test_parts": ("versions",),  # transformers' GPT-2 and Llama, FlopCounterMode, DTensor
    "test_server": ("versions",),  # FastAPI, Starlette, uvicorn, the openai client, transformers' tokenizer
    "test_chat_page": ("versions",),  # Playwright and Chromium
    # results that no library's version can change
    "test_layout": ("versionless",),
    "test_manifest": ("versionless",),
    "test_project": ("versionless",),
    "test_prose": ("versionless",),
    "test_record": ("versionless",),
}
# test function -> markers, where a module holds tests of several kinds
FUNCTION_MARKERS = {
    "test_notebook_runs_at_smoke_scale": ("notebook",),
    "test_a_notebook_that_leaves_a_tensor_on_the_cpu_fails_on_the_virtual_device": ("subprocess", "versions"),
    "test_a_run_resumes_on_a_device_other_than_the_cpu": ("versions",),  # the virtual accelerator: torch's modes
    "test_notebook_is_committed_clean": ("versionless",),
    "test_the_readme_links_every_lesson_to_colab": ("versionless",),
    "test_sync_bootstrap_inserts_updates_and_is_idempotent": ("versionless",),
    "test_every_lesson_is_on_the_core_path_or_a_deep_dive_after_the_core_notebook_it_extends": ("versionless",),
    "test_a_lessons_title_says_where_it_stands_on_the_path_with_links_that_resolve": ("versionless",),
    "test_the_readme_lists_the_core_path_in_order": ("versionless",),
    "test_bootstrap_outside_a_clone_without_network_says_what_to_do": ("versionless",),
    "test_bootstrap_inside_a_clone_uses_the_clone_as_it_is": ("versionless",),
    "test_bootstrap_shows_pips_progress_and_says_why_an_install_failed": ("subprocess", "versionless"),
    "test_bootstrap_installs_only_the_clone_the_first_cell_made": ("versionless",),
    "test_terminal_text_keeps_the_last_redraw_of_each_line": ("versionless",),
    "test_clean_outputs_keeps_what_a_reader_needs_from_the_streams": ("versionless",),
    "test_a_widget_bar_is_read_as_its_final_text": ("versionless",),
    "test_run_notebooks_records_a_stuck_or_dead_notebook_and_runs_the_next": ("subprocess", "serial"),
    "test_bad_arguments_are_usage_errors": ("versionless",),
    "test_no_command_names_the_commands": ("versionless",),
    "test_scale_defaults_are_written_once_and_shown_by_help": ("versionless",),
    "test_chapter_scripts_name_the_model_as_the_command_line_does": ("versionless",),
    "test_help_imports_no_benchmark_library": ("versions",),  # what torch and its plugins import at start-up
    "test_commands_print_no_warnings_of_the_libraries_they_use": ("versions",),  # their deprecations
    # the instruction set is read in a child interpreter (helpers.text.instructions.stdlib_instructions)
    "test_the_instruction_set_is_the_same_each_time_and_split_by_module": ("subprocess",),
    "test_dedent_is_asked_about_with_its_own_docstring": ("subprocess",),
    "test_a_program_that_patches_the_standard_library_gets_the_same_questions": ("subprocess",),
}
# fixture -> markers for every test that uses it, directly or through another fixture
FIXTURE_MARKERS = {"torchrun": ("distributed",), "python_process": ("subprocess",),
                   "server": ("subprocess",),  # test_server's: `python -m helpers serve` in a child process
                   "chat_data": ("subprocess",)}  # test_finetune's: the instruction set, read in a child process
IMPLIES = {"compile": ("versions",), "distributed": ("versions",)}


def pytest_addoption(parser):
    parser.addoption("--budget", metavar="PART", help="check the tests' time against PART's budget in tests/budget.py "
                     "(parallel, serial, fast), in units of this machine's speed")


def pytest_configure(config):
    if config.getoption("budget") and not hasattr(config, "workerinput"):  # the controlling process only
        from budget import SuiteBudget  # beside this file

        workers = getattr(config.option, "numprocesses", None)  # pytest-xdist's -n: a number once it has resolved it
        workers = workers if isinstance(workers, int) and workers > 0 else 1
        config.pluginmanager.register(SuiteBudget(config.getoption("budget"), workers), "suite-budget")
    if os.environ.get("PYTEST_XDIST_WORKER"):  # parallel workers: one thread each, for their children too
        torch.set_num_threads(1)
        os.environ["OMP_NUM_THREADS"] = "1"
    interpret_triton_in_this_process()


def pytest_unconfigure(config):
    os.environ.update(CLEARED)


def interpret_triton_in_this_process() -> None:
    """Without a GPU, Triton kernels run only in Triton's interpreter, which must be on when triton is imported:
    then the registry tests cover `flash_triton` like every other implementation. Switched on for this process
    alone (triton's own setting), not in the environment, so torchrun workers, command-line calls, scripts and
    notebooks run as a user's do; tests that need the interpreter elsewhere pass TRITON_INTERPRET=1 themselves."""
    if torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return
    os.environ["TRITON_INTERPRET"] = "1"
    import triton

    if getattr(triton, "knobs", None) is None:  # an older triton reads only the environment: leave it set
        return
    triton.knobs.runtime.interpret = True
    del os.environ["TRITON_INTERPRET"]


@pytest.hookimpl(tryfirst=True)  # before xdist's, which reads the xdist_group marks added here into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rpartition(".")[2]
        names = [*MODULE_MARKERS.get(module, ()), *FUNCTION_MARKERS.get(item.originalname, ())]
        names += [m for fixture in item.fixturenames for m in FIXTURE_MARKERS.get(fixture, ())]
        names += [m.name for m in item.iter_markers()]
        names += [implied for name in names for implied in IMPLIES.get(name, ())]
        for name in dict.fromkeys(names):
            if item.get_closest_marker(name) is None:
                item.add_marker(name)
        if shares_a_module_fixture(item):
            # tests sharing a module-scoped result (a torchrun launch, an interpreter run) go to one worker, so
            # the result is computed once (`--dist loadgroup`)
            item.add_marker(pytest.mark.xdist_group(module))
    # the long ones first (notebooks, then the groups sharing a launch): workers take tests in this order, so the
    # run ends on short unit tests that fill both workers rather than on one notebook with the other idle
    items.sort(key=lambda item: 0 if item.get_closest_marker("notebook") else
               1 if item.get_closest_marker("xdist_group") else 2)


def shares_a_module_fixture(item) -> bool:
    """Whether the test uses a fixture its own module defines with a scope wider than one test."""
    module_id = item.nodeid.partition("::")[0]
    definitions = item._fixtureinfo.name2fixturedefs  # pytest exposes the resolved fixtures only here
    return any(d[-1].baseid == module_id and d[-1].scope != "function" for d in definitions.values())


@pytest.fixture(autouse=True)
def keeps_the_thread_count():
    """A test that changes this process's torch thread count fails: the next tests on the worker would run with it,
    and two workers' OpenMP threads on two cores made tiny ops 25 times slower (a test of `record` left 2 threads on a
    worker, and a 2.5-second test took 60 s)."""
    threads = torch.get_num_threads()
    yield
    changed = torch.get_num_threads()
    if changed != threads:
        torch.set_num_threads(threads)
        pytest.fail(f"the test changed torch's thread count from {threads} to {changed} and did not put it back")


@pytest.fixture(scope="session")
def torchrun():
    """`helpers.parallel.launch.launch`: runs a script on several processes under torchrun."""
    return launch


@pytest.fixture(scope="session")
def python_process():
    """Run `python ARGS...` in a fresh interpreter (this one's), capturing text output."""

    def run(*args: str | Path, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=timeout,
                              **kwargs)

    return run


@pytest.fixture(scope="session")
def chapter_script():
    """Import a chapter's script (`ch05_training/gpu_benchmark.py`) as a module, to call its `main(argv)` here."""
    root = Path(__file__).resolve().parents[1]

    def load(relative: str):
        path = root / relative
        spec = importlib.util.spec_from_file_location(f"{path.parent.name}_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load
