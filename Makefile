# `make core` runs the core path's notebooks and `make course` every lesson headless into reports/, `make test`
# lints and runs every test (every notebook at smoke scale included), `make test-fast` the in-process unit tests
# while you work. All create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# What the notebooks need (`make lab`, `make course`), and the development tools on top (`make test`).
RUNTIME := $(VENV)/.installed-runtime
DEV := $(VENV)/.installed-dev
# Parallel test workers: one per core, at most 4 (each holds a model or a notebook kernel in memory).
WORKERS ?= $(shell $(PYTHON) -c 'import os; print(max(1, min(4, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)))')
NOTEBOOKS := $(sort $(wildcard ch*/*.ipynb))
SOLUTIONS := $(filter %/solutions.ipynb,$(NOTEBOOKS))
LESSONS := $(filter-out %/solutions.ipynb,$(NOTEBOOKS))
PARALLEL := -n $(WORKERS) --dist loadgroup
# What CI needs to see: the 25 slowest tests, and a test stuck past 15 minutes stopped by name. Each part ends with
# its wall time and its tests' time against its budget (tests/budget.py), in units of this machine's speed.
REPORT := --durations=25 --timeout=900
FAST := not (notebook or distributed or subprocess or compile or slow or serial)

.PHONY: setup browser core course solutions record lab test test-fast check sync-bootstrap clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "The course needs Python 3.10 or newer: make PYTHON=python3.12 ..."; exit 1; }
	$(PYTHON) -m venv $(VENV)

# On Linux without an NVIDIA driver, torch comes as its CPU build from PyTorch's own index: from PyPI, pip would take
# the CUDA build there, several GB that such a machine cannot use. Where that index is unreachable (only PyPI is, as in
# CI), pip takes torch from PyPI with the rest. An environment that already has torch keeps it. CPU_ONLY= turns it off.
CPU_TORCH_INDEX := https://download.pytorch.org/whl/cpu
CPU_ONLY ?= $(shell [ "$$(uname -s)" = Linux ] && ! command -v nvidia-smi >/dev/null 2>&1 && echo yes)

$(RUNTIME): $(BIN)/python requirements.txt pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
ifeq ($(CPU_ONLY),yes)
	@$(BIN)/python -c 'import torch' 2>/dev/null || $(BIN)/python -m pip install --quiet torch --index-url \
		$(CPU_TORCH_INDEX) --timeout 10 --retries 1 || echo "PyTorch's CPU index is unreachable: pip takes torch from PyPI"
endif
	$(BIN)/python -m pip install --quiet -r requirements.txt -e .
	@touch $@

$(DEV): $(RUNTIME)
	$(BIN)/python -m pip install --quiet -e ".[dev]"
	@touch $@

setup: $(DEV)  ## create .venv and install everything, the development tools included

browser:  ## install Debian's Chromium, which the chat page's test drives, unless a `chromium` is already there
	@command -v chromium >/dev/null || { \
		sudo=$$(test "$$(id -u)" = 0 || echo sudo); \
		$$sudo apt-get install -y --no-install-recommends chromium || \
		{ $$sudo apt-get update && $$sudo apt-get install -y --no-install-recommends chromium; }; }

core: $(RUNTIME)  ## execute the core path's notebooks headless, in order, into reports/ (COURSE_SMOKE=1 for the smoke scale)
	$(BIN)/python -m helpers run-notebooks --out reports --core

course: $(RUNTIME)  ## execute the lessons headless into reports/ (COURSE_SMOKE=1 for the smoke scale)
	$(BIN)/python -m helpers run-notebooks --out reports $(LESSONS)

solutions: $(RUNTIME)  ## execute every chapter's solutions notebook headless into reports/
	$(BIN)/python -m helpers run-notebooks --out reports $(SOLUTIONS)

record: $(RUNTIME)  ## re-record every notebook in place at the default scale, one at a time, refusing a busy machine
	$(BIN)/python -m helpers record

lab: $(RUNTIME)  ## open the course in JupyterLab
	$(BIN)/jupyter lab

test: $(DEV) browser  ## ruff + every test: in parallel workers, then the timing- and memory-sensitive ones alone
	$(BIN)/ruff check .
	$(BIN)/python -m pytest $(PARALLEL) $(REPORT) --budget parallel -m "not serial"
	$(BIN)/python -m pytest $(REPORT) --budget serial -m serial

test-fast: $(DEV)  ## the in-process unit tests (no notebooks, torchrun, subprocesses or compiles): a few minutes
	$(BIN)/python -m pytest $(PARALLEL) --budget fast -m "$(FAST)"

check: $(RUNTIME)  ## [OK]/[FAIL] per requirement and capability
	$(BIN)/python setup/check_env.py

sync-bootstrap: $(RUNTIME)  ## write the bootstrap cell (repository address) into every notebook
	$(BIN)/python -m helpers sync-bootstrap

clean:
	rm -rf $(VENV) reports .pytest_cache .ruff_cache
