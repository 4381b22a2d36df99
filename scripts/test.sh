#!/usr/bin/env bash
# The test suite: setup (packages, venv, build), the C tests, the C tests again under AddressSanitizer and
# UndefinedBehaviorSanitizer, the Python tests with real processes on the newest stack (requirements.txt), then the
# wheel and the version-dependent Python tests on the oldest stack (requirements-oldest.txt). Each stage prints its
# own summary.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
# How long each stage took, printed at the end (the suite should stay well under 30 minutes on 2 cores).
TIMES=""
T_STAGE=$SECONDS
stage_done() { TIMES="$TIMES$1 $((SECONDS - T_STAGE)) s, "; T_STAGE=$SECONDS; }
trap 'echo "== stage times: ${TIMES}total $SECONDS s"' EXIT
VENV="$(scripts/setup.sh | tail -n 1)"
# The builds below (the ASan one, the oldest stack's wheel, the tests' own) go through ccache as setup's did.
. "$ROOT/scripts/ccache-env.sh"
stage_done "setup+build"
JOBS="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # GNU nproc honours OMP_NUM_THREADS, set below for the ranks

echo "== C tests (build/)"
ctest --test-dir build --output-on-failure -j 1
stage_done "C"

echo "== C tests under AddressSanitizer + UndefinedBehaviorSanitizer (build-asan/)"
cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=Debug -DT3D_SANITIZE=address,undefined -DT3D_BUILD_SHIM=OFF >/dev/null
cmake --build build-asan -j "$JOBS" >/dev/null
# UCX keeps process-lifetime allocations of its own; leaks inside t3d are still reported.
export LSAN_OPTIONS="suppressions=$ROOT/.ci/lsan.supp:print_suppressions=0"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
ctest --test-dir build-asan --output-on-failure -j 1
stage_done "ASan build+C"

echo "== Python tests (tests/python, backend t3d), newest stack: $("$VENV/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)')"
export OMP_NUM_THREADS=1
# test_wheel runs below, on the oldest stack's wheel (one wheel build, not two). --durations: the slowest tests, to
# keep the suite's time in view.
"$VENV/bin/python" -m pytest -q --durations=25 tests/python --ignore=tests/python/test_wheel.py "$@"
stage_done "Python newest"

# transformers 5.17, the GPU machines' (docs/benchmarks/gpu/): between the two ends, with a tensor-parallel API of
# its own (5.16 .. 5.22: no _resolve_parallel_plans). Only transformers changes: its wheel alone, kept outside the
# clone like the venvs, ahead of the newest venv's on PYTHONPATH; the TP adapters and the 3-D training run on it.
MID_TF=5.17.0
MID="${XDG_CACHE_HOME:-$HOME/.cache}/t3d/transformers-$MID_TF"
if [ ! -f "$MID/.complete" ]; then
  rm -rf "$MID"
  "$VENV/bin/python" -m pip install -q --no-deps --no-compile --target "$MID" "transformers==$MID_TF"
  touch "$MID/.complete"
fi
echo "== transformers $MID_TF (the GPU machines'), newest torch"
PYTHONPATH="$MID${PYTHONPATH:+:$PYTHONPATH}" "$VENV/bin/python" -m pytest -q tests/python/test_compat.py \
  tests/python/test_train.py -k "tp_api or mesh_loading or tp_adapters or (test_equivalence and dp2xtp2xcp2)"
stage_done "transformers $MID_TF"

# The oldest stack: the package as `pip wheel .` builds it against that torch, installed (not editable) into the
# oldest venv, then the wheel's own test and every Python test that touches a version-dependent path.
OLD="$(scripts/setup.sh --stack oldest | tail -n 1)"
echo "== Oldest stack: $("$OLD/bin/python" -c 'import torch, transformers; print("torch", torch.__version__, "transformers", transformers.__version__)' 2>/dev/null)"
rm -rf build-oldest/dist
"$OLD/bin/python" -m pip wheel -q . --no-build-isolation --no-deps -w build-oldest/dist \
  -Cbuild-dir=build-oldest/skbuild
WHEEL="$(ls build-oldest/dist/t3d-*.whl)"
"$OLD/bin/python" -m pip install -q --no-deps --force-reinstall "$WHEEL"
stage_done "oldest setup+wheel"
T3D_TEST_WHEEL="$ROOT/$WHEEL" "$OLD/bin/python" -m pytest -q tests/python/test_wheel.py
"$OLD/bin/python" -m pytest -q tests/python/test_compat.py tests/python/test_cp.py tests/python/test_ring_attention.py \
  tests/python/test_hf_attention.py tests/python/test_pipeline.py tests/python/test_train.py \
  tests/python/test_upstream_example.py tests/python/test_dcp.py tests/python/test_dtensor.py \
  tests/python/test_fsdp.py tests/python/test_build_info.py -m "not newest_only"
stage_done "Python oldest"
