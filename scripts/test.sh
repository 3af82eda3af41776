#!/usr/bin/env bash
# Install (scripts/install.sh), then run the C++ unit tests (CMake + GoogleTest, ctest) and the Python tests (pytest).
# Tests marked `gpu` are skipped on machines without a CUDA device. Extra arguments go to pytest; without any, the
# drop-in, parity and architecture-sweep tests run a second time on the other supported transformers release.
set -euo pipefail
cd "$(dirname "$0")/.."

bash scripts/install.sh

# GoogleTest and CMake come from the system's packages (Debian: libgtest-dev, cmake).
if ! [ -e /usr/include/gtest/gtest.h ] || ! command -v cmake >/dev/null; then
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq libgtest-dev cmake >/dev/null
    else
        echo "GoogleTest (libgtest-dev) and cmake are needed for the C++ tests; install them and rerun" >&2
        exit 1
    fi
fi
cmake -S . -B build/cmake -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cmake -j "$(nproc)" >/dev/null
ctest --test-dir build/cmake --output-on-failure

PY="${CBCORE_VENV:-.venv}/bin/python"
"$PY" -m pytest -q "$@"

# A whole run (no arguments) then runs the drop-in, parity and architecture-sweep tests (and the tool-call parsing
# that uses transformers' response templates) again on the other supported transformers release
# (scripts/transformers_versions.sh), whose overlay install.sh put beside the venv. The compiled cases are left out
# of this second pass: each compiles the step afresh for the other release's model code (minutes with inductor's
# cache cold), and the compiled step's own tests run on the first.
if [ "$#" -eq 0 ]; then
    source scripts/transformers_versions.sh
    PYTHONPATH="$OVERLAY${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider \
        tests/test_transformers_parity.py tests/test_transformers_suite.py tests/test_transformers_serving.py \
        tests/test_differences.py tests/test_hostile_arguments.py tests/test_model_support.py \
        tests/test_architecture_sweep.py \
        "tests/test_server_structured_output.py::test_tool_choice_auto_parses_the_models_own_tool_call_format" \
        --deselect tests/test_transformers_suite.py::test_config_combinations_with_compile_equal_generate \
        --deselect tests/test_transformers_suite.py::test_long_generation_equals_generate \
        --deselect "tests/test_transformers_suite.py::test_gemma2_with_soft_capping_and_sliding_layers_equals_generate[False-True]"
fi
