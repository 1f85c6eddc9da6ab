# Two commands a newcomer needs, each creating its own environment on first use:
#   make bench   the main job (`ttj-bench`: the small CPU suite here, --suite official on a GPU)
#   make test    the whole test suite (CPU; GPU-only paths are run on the H200 by bench scripts)
#   make test-fast  the quick tier (-m 'not slow'); make lint  ruff
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BENCH_ARGS ?=

.PHONY: test test-fast lint bench env clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	# The CPU build of torch, pinned: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -m pip install -q "torch==2.13.0"
	$(PY) -m pip install -q -e ".[test,bench]"
	touch $@

env: $(VENV)/.installed

test: $(VENV)/.installed
	$(PY) -m pytest -q

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check .

test-fast: $(VENV)/.installed
	$(PY) -m pytest -q -m "not slow"

bench: $(VENV)/.installed
	$(VENV)/bin/ttj-bench $(BENCH_ARGS)

clean:
	rm -rf $(VENV) .pytest_cache .hypothesis
