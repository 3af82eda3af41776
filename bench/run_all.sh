#!/usr/bin/env bash
# Every side-by-side run whose results are committed under bench/results/ (one `python -m cbcore bench` per
# workload and dtype, each peer run 3 times, interleaved; about three hours on 2 cores). fp32 runs include the
# per-prompt `model.generate` reference, so they check token agreement; bf16 runs leave it out (its
# one-prompt-at-a-time decode alone takes minutes) and compare speed and memory only. Needs bench/setup_vllm.sh first
# for the vLLM rows (they are skipped otherwise); vLLM's KV cache is the bench's default, 2 GiB.
# REPEAT=1 for a quicker pass, WORKLOADS="W1 W3" for some workloads only.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${CBCORE_VENV:-.venv}/bin/python"
peers_fp32="reference,cbcore,cbcore-1t,transformers,generate,vllm,vllm-2c"
peers_bf16="cbcore,transformers,generate,vllm,vllm-2c"
for workload in ${WORKLOADS:-W1 W2 W3 W4}; do
    "$PY" -m cbcore bench --workload "$workload" --dtype float32 --peers "$peers_fp32" --repeat "${REPEAT:-3}"
done
for workload in ${WORKLOADS:-W1 W2 W3 W4}; do
    "$PY" -m cbcore bench --workload "$workload" --dtype bfloat16 --peers "$peers_bf16" --repeat "${REPEAT:-3}"
done
