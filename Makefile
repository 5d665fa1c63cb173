# Two commands for a newcomer: `make demo` (set up, then run the main job) and `make test`.
# The demo installs only what it runs (the runtime dependencies); the test tools (ruff, mypy,
# pytest, hypothesis, the [http] and [postgres] extras) come with the first `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
RUNTIME := $(VENV)/.installed-runtime
TOOLS := $(VENV)/.installed-test
# Tests run in parallel, one process per CPU; a file's tests stay together, so module and
# session fixtures (the demo store, the docs' examples, a PostgreSQL database) are made once
# per file, not once per process.
PYTEST_ARGS ?= -n auto --dist loadfile

.PHONY: demo test lint bench clean

$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $(RUNTIME)

$(TOOLS): $(RUNTIME)
	$(PIP) -e '.[test]'
	touch $(TOOLS)

demo: $(RUNTIME)
	$(VENV)/bin/staging-store demo

test: $(TOOLS)
	$(VENV)/bin/ruff check store migrations tests tools
	$(VENV)/bin/mypy
	$(PY) -m pytest $(PYTEST_ARGS)

bench: $(TOOLS)
	$(PY) tools/bench_records.py
	$(PY) tools/bench_staging.py
	$(PY) tools/bench_bytes.py
	$(PY) tools/bench_cuts.py
	$(PY) tools/bench_audit.py
	$(PY) tools/bench_replay.py
	$(PY) tools/bench_linearize.py
	$(PY) tools/bench_retention.py
	$(PY) tools/bench_coordinator.py
	$(PY) tools/bench_http.py
	@if $(PY) -c "import torch, transformers" 2>/dev/null; then $(PY) tools/bench_engine.py; \
	else echo "tools/bench_engine.py skipped: it needs torch and the [transformers] extra"; fi
	$(PY) tools/bench_cli_tables.py

clean:
	rm -rf $(VENV) demo-store build *.egg-info
