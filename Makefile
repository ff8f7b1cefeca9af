# Set-up and everyday commands. `make demo` / `make reproduce` and `make test` work on a fresh machine:
# they create .venv, install the pinned CPU build of torch and what they need, then run.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel; GPU users install their own torch first (the package requires torch>=2.1).
TORCH ?= torch==2.13.0

.PHONY: install test test-all test-transformers-floor lint demo reproduce bench docs dist clean

# What the studies need: torch, the library with its compiled kernel (`fast`: the studies'
# numbers were measured with it) and the research part (research/), editable.
$(VENV)/.core: pyproject.toml research/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[fast]" -e research
	touch $@

# The tests: every extra they exercise (Triton, ONNX, transformers, TensorBoard, Slurm) on top.
$(VENV)/.installed: $(VENV)/.core
	$(PY) -m pip install -q -e ".[dev,export,transformers,tensorboard,fast]" -e "research[cluster]"
	touch $@

install: $(VENV)/.installed

# Compile the numba kernel once (cached on disk) before the tests, so no test's time limit
# includes the first compilation (about 30 s on an idle 2-core machine).
test: install
	$(PY) -c "from dselectk.kernels import warm_kernels; print(f'numba kernels ready in {warm_kernels():.0f} s')"
	$(PY) -m pytest

test-all: install
	$(PY) -m pytest -m ""

# The transformers adapter's tests on the lowest transformers version pyproject declares (the
# `transformers` extra), in a venv of its own; `make test` runs them on the installed version.
TRANSFORMERS_FLOOR ?= 5.23.0
FLOOR_VENV ?= .venv-transformers-floor
HF_TESTS := tests/test_hf_adapter.py tests/test_hf_persistence.py tests/test_hf_by_name.py \
	tests/test_token_moe_hf.py

test-transformers-floor:
	$(PYTHON) -m venv $(FLOOR_VENV)
	$(FLOOR_VENV)/bin/python -m pip install -q "$(TORCH)"
	$(FLOOR_VENV)/bin/python -m pip install -q "transformers==$(TRANSFORMERS_FLOOR)" "accelerate>=1.0" \
		"pytest>=7" "hypothesis>=6" "numba>=0.60" -e .
	$(FLOOR_VENV)/bin/python -m pytest $(HF_TESTS)

lint: install
	$(VENV)/bin/ruff check src tests benchmarks research examples docs/hooks.py
	$(VENV)/bin/ruff format --check src tests benchmarks research examples docs/hooks.py
	$(VENV)/bin/mypy

demo: $(VENV)/.core
	$(VENV)/bin/dselectk demo

reproduce: $(VENV)/.core
	$(VENV)/bin/dselectk reproduce synthetic

bench: install
	$(PY) -m benchmarks --quick

# The documentation site (site/), built with strict warnings: a broken link or reference fails.
$(VENV)/.docs: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[docs]"
	touch $@

docs: $(VENV)/.docs
	$(VENV)/bin/mkdocs build --strict

# The library's wheel and sdist (dist/); the research part is not in them.
dist: install
	rm -rf dist
	$(PY) -m build --outdir dist .

clean:
	rm -rf $(VENV) $(FLOOR_VENV) build dist site src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
