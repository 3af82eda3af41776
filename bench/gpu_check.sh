#!/usr/bin/env bash
# The GPU checks of cbcore's CUDA kernels, in one go on a machine with a CUDA device:
#   1. build cbcore._C and cbcore._cuda in place (no network, no pip resolution),
#   2. `pytest -m gpu` (every gpu-marked test under tests/),
#   3. the CUDA microbenchmarks, with --benchmark-json,
#   4. a summary: device, versions, build time, test and benchmark outcome.
#
# Usage, from anywhere:  bash bench/gpu_check.sh [RESULTS_DIR]      (default: bench/results)
# Files written to RESULTS_DIR: gpu_check_summary.md, kernels_cuda.json, kernels_cuda.md, build.log, pytest_gpu.log,
# bench.log (six files, so the whole folder can come back from a device machine that returns at most eight).
#
# Python: $CBCORE_PYTHON, else .venv/bin/python when it has torch, else python3 when it has torch (a GPU image's
# own), else scripts/install.sh makes .venv (that needs the package registry). The machine's torch is used as it is:
# its version may differ from setup.py's pin, which only matters to pip, and pip is not used here.
# Wheels: when .whl/ holds *.whl files (for example transformers==5.24.0, which cbcore is written against, when the
# machine has another version), they are installed with --no-deps into a private folder put first on PYTHONPATH.
# Fetch them on a machine with the registry: bash bench/gpu_check.sh --fetch-wheels
#
# Environment: CUDA_HOME (default /usr/local/cuda), MAX_JOBS (default: all cores), CBCORE_CUDA_ARCHS (default: the
# present GPU's compute capability, e.g. "90", to keep the build short), GPU_CHECK_PYTEST_ARGS (extra pytest args).
# Exit status: 0 when the build, the tests and the benchmarks all passed.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

if [ "${1:-}" = "--fetch-wheels" ]; then
    # transformers is pure Python (one wheel for every platform); its own requirements are usually on a GPU image.
    mkdir -p .whl
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: -d .whl "transformers==5.24.0"
    exit $?
fi

RESULTS=${1:-bench/results}
mkdir -p "$RESULTS"
RESULTS=$(cd "$RESULTS" && pwd)
SUMMARY=$RESULTS/gpu_check_summary.md
export PYTHONUNBUFFERED=1

# ---- python ----------------------------------------------------------------------------------------------------------
has_torch() { [ -x "$1" ] || command -v "$1" >/dev/null 2>&1 || return 1; "$1" -c "import torch" >/dev/null 2>&1; }
PY=${CBCORE_PYTHON:-}
if [ -z "$PY" ]; then
    if has_torch .venv/bin/python; then PY=.venv/bin/python
    elif has_torch python3; then PY=$(command -v python3)
    else
        echo "no Python with torch found; creating .venv with scripts/install.sh" >&2
        bash scripts/install.sh && PY=.venv/bin/python || { echo "install failed" >&2; exit 1; }
    fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
    SITE=$(mktemp -d /tmp/cbcore-site.XXXX)
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" .whl/*.whl \
        && export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_HOME=${CUDA_HOME:-/usr/local/cuda}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
if [ -z "${CBCORE_CUDA_ARCHS:-}" ]; then
    CBCORE_CUDA_ARCHS=$("$PY" -c "import torch; m, n = torch.cuda.get_device_capability(); print(f'{m}{n}')" 2>/dev/null \
        || echo "80;90")
    export CBCORE_CUDA_ARCHS
fi

{
    echo "# cbcore GPU check"
    echo
    echo "- date: $(date -u +%Y-%m-%dT%H:%M:%SZ); commit: $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    "$PY" - <<'EOF'
import platform, torch
print(f"- python {platform.python_version()}, torch {torch.__version__}, CUDA {torch.version.cuda}")
try:
    import transformers
    print(f"- transformers {transformers.__version__}")
except Exception as error:  # noqa: BLE001
    print(f"- transformers: not importable ({error})")
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(f"- device: {p.name}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.0f} GiB, "
          f"compute capability {p.major}.{p.minor}")
else:
    print("- device: none visible to torch")
EOF
    echo "- nvcc: $("$CUDA_HOME/bin/nvcc" --version 2>/dev/null | tail -1)"
    echo "- CBCORE_CUDA_ARCHS=$CBCORE_CUDA_ARCHS MAX_JOBS=$MAX_JOBS"
} > "$SUMMARY"

status=0

# ---- 1. build --------------------------------------------------------------------------------------------------------
start=$(date +%s)
"$PY" setup.py build_ext --inplace > "$RESULTS/build.log" 2>&1
build_rc=$?
build_s=$(( $(date +%s) - start ))
{
    echo
    echo "## build"
    echo
    echo "\`python setup.py build_ext --inplace\`: exit $build_rc in ${build_s}s (log: build.log)"
} >> "$SUMMARY"
if [ $build_rc -ne 0 ]; then
    tail -40 "$RESULTS/build.log" >&2
    echo "build failed; see build.log" >> "$SUMMARY"
    cat "$SUMMARY"
    exit 1
fi
"$PY" -c "import cbcore._cuda, cbcore._C; print('cbcore._cuda loaded from', cbcore._cuda.__file__)" >> "$RESULTS/build.log" 2>&1 \
    || { echo "cbcore._cuda does not import; see build.log" >> "$SUMMARY"; status=1; }

# ---- 2. tests --------------------------------------------------------------------------------------------------------
start=$(date +%s)
# shellcheck disable=SC2086
"$PY" -m pytest -m gpu -q -p no:cacheprovider ${GPU_CHECK_PYTEST_ARGS:-} tests > "$RESULTS/pytest_gpu.log" 2>&1
test_rc=$?
{
    echo
    echo "## pytest -m gpu"
    echo
    echo "exit $test_rc in $(( $(date +%s) - start ))s: $(tail -1 "$RESULTS/pytest_gpu.log")"
    if [ $test_rc -ne 0 ]; then
        echo
        echo '```'
        grep -E "^(FAILED|ERROR)" "$RESULTS/pytest_gpu.log" | head -40
        echo '```'
    fi
} >> "$SUMMARY"
[ $test_rc -eq 0 ] || status=1

# ---- 3. benchmarks ---------------------------------------------------------------------------------------------------
start=$(date +%s)
CBCORE_BENCH_RESULTS=$RESULTS "$PY" -m pytest bench/test_bench_kernels_cuda.py -m gpu -q -p no:cacheprovider -s \
    --benchmark-json "$RESULTS/kernels_cuda.json" --benchmark-columns=median,rounds > "$RESULTS/bench.log" 2>&1
bench_rc=$?
{
    echo
    echo "## benchmarks"
    echo
    echo "exit $bench_rc in $(( $(date +%s) - start ))s: $(tail -1 "$RESULTS/bench.log") (JSON: kernels_cuda.json)"
    echo
    if [ -f "$RESULTS/kernels_cuda.md" ]; then sed -n '/^| case/,$p' "$RESULTS/kernels_cuda.md"; fi
} >> "$SUMMARY"
[ $bench_rc -eq 0 ] || status=1

echo >> "$SUMMARY"
echo "overall: $([ $status -eq 0 ] && echo PASS || echo FAIL)" >> "$SUMMARY"
cat "$SUMMARY"
exit $status
