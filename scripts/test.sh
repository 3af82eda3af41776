#!/usr/bin/env bash
# Install (scripts/install.sh), then run the C++ unit tests (CMake + GoogleTest, ctest) and the Python tests (pytest).
# Tests marked `gpu` are skipped on machines without a CUDA device. Extra arguments go to pytest.
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

"${CBCORE_VENV:-.venv}/bin/python" -m pytest -q "$@"
