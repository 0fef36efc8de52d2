# triton-disagg: every target installs what it needs into .venv on first use.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export MODEL_DIR ?= $(CURDIR)/.models/tiny

.PHONY: install model test lint format bench-engine

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	touch $@

install: $(STAMP)

model: $(STAMP)
	$(VENV)/bin/disagg make-model --out "$(MODEL_DIR)" --if-missing

lint: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .
	$(PY) -m ruff check --fix .

test: model lint
	$(PY) -m pytest -q

bench-engine: model
	$(PY) perf/engine_bench.py
