# triton-disagg: every target installs what it needs into .venv on first use.
SHELL := /bin/bash
VENV := $(CURDIR)/.venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export MODEL_DIR ?= $(CURDIR)/.models/tiny

.PHONY: install model test lint format bench-engine serve

# The Triton server binaries (pin: the `serve` extra) go in with --no-deps: only the binaries are used.
$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check -e '.[test]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps $$($(PY) -c 'import tomllib; \
		print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["serve"])')
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

# Triton in the foreground on model_repository/ (ports: HTTP_PORT, GRPC_PORT, METRICS_PORT; extra
# flags of `disagg serve` in SERVE_ARGS). Ctrl-C or SIGTERM stops it, draining streams in flight.
serve: model
	$(PY) -c 'import sys; from disagg.server import serve_main; sys.exit(serve_main(sys.argv[1:]))' $(SERVE_ARGS)
