#!/usr/bin/env bash
# The test suite: setup (packages, venv, build), the C tests, the C tests again under AddressSanitizer and
# UndefinedBehaviorSanitizer, then the Python tests with real processes. Each stage prints its own summary.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
VENV="$(scripts/setup.sh | tail -n 1)"
JOBS="$(nproc)"

echo "== C tests (build/)"
ctest --test-dir build --output-on-failure -j 1

echo "== C tests under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DT3D_SANITIZE=address,undefined -DT3D_BUILD_SHIM=OFF >/dev/null
cmake --build build-asan -j "$JOBS" >/dev/null
# UCX keeps process-lifetime allocations of its own; leaks inside t3d are still reported.
export LSAN_OPTIONS="suppressions=$ROOT/.ci/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
ctest --test-dir build-asan --output-on-failure -j 1

echo "== Python tests (tests/python, backend t3d)"
export OMP_NUM_THREADS=1
"$VENV/bin/python" -m pytest -q tests/python "$@"
