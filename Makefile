# Two commands do everything: `make course` (run every notebook headless into reports/) and
# `make test` (lint + unit tests + every notebook at smoke scale). Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup course record lab test lint check sync-bootstrap clean

$(BIN)/python:
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || \
		{ echo "The course needs Python 3.10 or newer: make PYTHON=python3.12 ..."; exit 1; }
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python requirements.txt pyproject.toml
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -r requirements.txt -e ".[dev]"
	@touch $@

setup: $(STAMP)  ## create .venv and install everything

course: $(STAMP)  ## execute every notebook headless into reports/ (COURSE_SMOKE=1 for the smoke scale)
	$(BIN)/python -m helpers run-notebooks --out reports

record: $(STAMP)  ## re-record every notebook in place at the default scale, one at a time, refusing a busy machine
	$(BIN)/python -m helpers record

lab: $(STAMP)  ## open the course in JupyterLab
	$(BIN)/jupyter lab

test: $(STAMP)  ## ruff + pytest (unit tests and every notebook at smoke scale)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest

check: $(STAMP)  ## [OK]/[FAIL] per requirement and capability
	$(BIN)/python setup/check_env.py

sync-bootstrap: $(STAMP)  ## write the bootstrap cell (repository address) into every notebook
	$(BIN)/python -m helpers sync-bootstrap

clean:
	rm -rf $(VENV) reports .pytest_cache .ruff_cache
