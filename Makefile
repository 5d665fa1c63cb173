# Two commands for a newcomer: `make demo` (set up, then run the main job) and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/staging-store demo

test: $(STAMP)
	$(VENV)/bin/ruff check store migrations tests tools
	$(VENV)/bin/mypy
	$(PY) -m pytest

bench: $(STAMP)
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

clean:
	rm -rf $(VENV) demo-store build *.egg-info
