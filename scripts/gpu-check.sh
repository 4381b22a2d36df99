#!/usr/bin/env bash
# The GPU check: one command for the GPU machines this project is sometimes lent (offline; their python3 holds a
# CUDA torch, nvidia-nccl-cu13, pytest; CUDA's nvcc, cmake and ninja are there; UCX and GoogleTest are not).
#
#   scripts/gpu-check.sh prepare [--kit DIR]     here, on the Debian machine: copy what the GPU machine lacks (GoogleTest's
#                                                sources) into .gpu-kit/ (ignored), print its size and how to carry it
#   scripts/gpu-check.sh [--out DIR] [options]   there, from the repository root: build t3d without UCX, with the CUDA
#                                                kernels, into build-gpu/, run the C tests, the CUDA tests, the NCCL path
#                                                at one rank through torch, the attention benchmark; write one report
#
# Every step runs, whatever the earlier ones did (a step that needs what failed is skipped with that reason); the
# report ($OUT/gpu-check-report.md; default docs/benchmarks/gpu/, or build-gpu/gpu-check/ without a GPU) is rewritten
# after every step, and the script exits 1 if any step failed. Without a GPU (--no-gpu, or none found) it runs the
# kit check and the build exactly as on the GPU machine and records every step that needs the GPU as skipped.
#
# Options:
#   --out DIR            where the report goes (with --out, the step logs go there too, as gpu-check-logs.tar.gz)
#   --kit DIR            the kit made by `prepare` (default .gpu-kit)
#   --build-dir DIR      the build directory (default build-gpu)
#   --python PY          the interpreter whose torch t3d is built against (default python3; without a GPU and without
#                        torch in python3: the project's venv, ~/.cache/t3d/venv-<hash>, used read-only)
#   --no-gpu             build only: record the GPU steps as skipped
#   --jobs N             build parallelism (default: the number of cores, at most 16)
#   --cuda-archs LIST    T3D_CUDA_ARCHS of the CUDA kernels (default 90)
#   --no-cuda-kernels    configure with T3D_BUILD_CUDA=OFF (CI uses it to keep its build short)
#   --targets "A B"      build only these targets (CI: the library, the kernels, the shim, GoogleTest)
#   --deadline S         finish within S seconds of the start: a step that no longer fits is skipped, a running
#                        one is stopped (the device tool's commands run for at most 600 s: use --deadline 570)
#   --skip A,B           skip these steps (e.g. a second call on the still-warm machine, whose build-gpu/ is kept:
#                        --skip nccl-1rank,pytest-cuda,pytest-attention-cuda,train-cuda,bench-attention,bench-collectives,
#                        bench-collectives-shared to run the C tests)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
T0=$(date +%s)

MODE=run
if [ "${1:-}" = prepare ]; then MODE=prepare; shift; fi
OUT=""
KIT="$ROOT/.gpu-kit"
BUILD="$ROOT/build-gpu"
PY=""
FORCE_NO_GPU=0
# The cores this process may use. GNU nproc also honours OMP_NUM_THREADS, which the test suite sets to 1 for its
# ranks (scripts/test.sh): that is not a limit on the build, so it is left out here.
cores() { env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc; }
JOBS="$(cores)"; [ "$JOBS" -gt 16 ] && JOBS=16
CUDA_ARCHS=90
CUDA_KERNELS=1
TARGETS=""
DEADLINE=0
SKIP=","
abspath() { case "$1" in /*) printf '%s\n' "$1" ;; *) printf '%s\n' "$PWD/$1" ;; esac; }
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$(abspath "$2")"; shift 2 ;;
    --kit) KIT="$(abspath "$2")"; shift 2 ;;
    --build-dir) BUILD="$(abspath "$2")"; shift 2 ;;
    --python) PY="$2"; shift 2 ;;
    --no-gpu) FORCE_NO_GPU=1; shift ;;
    --jobs) JOBS="$2"; shift 2 ;;
    --cuda-archs) CUDA_ARCHS="$2"; shift 2 ;;
    --no-cuda-kernels) CUDA_KERNELS=0; shift ;;
    --targets) TARGETS="$2"; shift 2 ;;
    --deadline) DEADLINE="$2"; shift 2 ;;
    --skip) SKIP=",$2,"; shift 2 ;;
    -h|--help) sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu-check.sh: unknown argument '$1' (--help lists them)" >&2; exit 2 ;;
  esac
done

# ---- prepare (here) ------------------------------------------------------------------------------------------------
if [ "$MODE" = prepare ]; then
  GTEST_SRC="${T3D_GTEST_SRC:-/usr/src/googletest}"
  if [ ! -f "$GTEST_SRC/CMakeLists.txt" ]; then
    echo "gpu-check.sh prepare: no GoogleTest sources in $GTEST_SRC (Debian: apt-get install googletest," \
         "or set T3D_GTEST_SRC)" >&2
    exit 1
  fi
  mkdir -p "$KIT"
  rm -rf "$KIT/googletest.tmp"
  cp -rL "$GTEST_SRC" "$KIT/googletest.tmp"
  rm -rf "$KIT/googletest"
  mv "$KIT/googletest.tmp" "$KIT/googletest"
  # Python packages the GPU machines lack: datasets at requirements.txt's pin and the two of its dependencies their
  # image lacks (the training demo), pytest-xdist and execnet (the pytest steps run their tests on several workers);
  # wheels for their Python 3.12, installed there into $BUILD/kit-site. T3D_GPU_KIT_WHEELS replaces the list (empty:
  # none).
  wheels="${T3D_GPU_KIT_WHEELS-$(grep -E '^datasets==' "$ROOT/requirements.txt" || true) dill==0.4.0 multiprocess==0.70.18 pytest-xdist==3.8.0 execnet==2.1.1}"
  rm -rf "$KIT/wheels"
  if [ -n "$wheels" ]; then
    # shellcheck disable=SC2086
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 -d "$KIT/wheels" $wheels \
      || echo "gpu-check.sh prepare: warning: could not download the kit's wheels (the training step will fail there)" >&2
  fi
  commit="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
  dirty="$(git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | wc -l)"
  gver="$(dpkg-query -W -f='${Version}' googletest 2>/dev/null || echo unknown)"
  {
    echo "# What scripts/gpu-check.sh needs on the GPU machines that they lack (made by \`gpu-check.sh prepare\`)"
    echo "PREPARED=$(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "COMMIT=$commit"
    echo "DIRTY_FILES=$dirty"
    echo "GOOGLETEST=googletest $gver (from $GTEST_SRC)"
  } >"$KIT/kit.env"
  if [ "${KIT#"$ROOT"/}" != "$KIT" ] && ! git -C "$ROOT" check-ignore -q "$KIT" 2>/dev/null; then
    echo "gpu-check.sh prepare: warning: $KIT is not ignored by git (add it to .gitignore)" >&2
  fi
  kit_bytes="$(du -sb "$KIT" | cut -f1)"
  tree_bytes="$(cd "$ROOT" && git ls-files -z -co --exclude-standard 2>/dev/null \
               | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1 || echo 0)"
  total=$(( kit_bytes + tree_bytes ))
  mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
  echo "kit: $KIT ($(mib "$kit_bytes")): googletest $gver; commit ${commit:0:12} ($dirty modified tracked files)"
  echo "travels with the working tree ($(mib "$tree_bytes")): $(mib "$total") of the device tool's 64 MiB"
  [ "$total" -gt $(( 64 * 1048576 )) ] && echo "gpu-check.sh prepare: warning: over 64 MiB" >&2
  rel="${KIT#"$ROOT"/}"
  echo "carry it: device run with carry [\"$rel\"], timeout_s 600, command:"
  echo "  bash scripts/gpu-check.sh --out \$OUT --deadline 570"
  exit 0
fi

# ---- run (there) ---------------------------------------------------------------------------------------------------
STATE="$BUILD/gpu-check"          # per-step results, logs, and the report when no --out is given
LOGS="$STATE/logs"
rm -rf "$STATE"
mkdir -p "$LOGS"
if [ -z "$OUT" ]; then OUT_GIVEN=0; else OUT_GIVEN=1; fi

# The interpreter: python3 (on the GPU machines, /opt/torch/.venv/bin/python3 with its CUDA torch).
has_torch() { TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$1" -c 'import torch' >/dev/null 2>&1; }
if [ -z "$PY" ]; then
  PY="$(command -v python3 || echo python3)"
  if ! has_torch "$PY"; then
    venv="${XDG_CACHE_HOME:-$HOME/.cache}/t3d/venv-$(sha256sum "$ROOT/requirements.txt" | cut -c1-12)"
    [ -x "$venv/bin/python" ] && PY="$venv/bin/python"
  fi
fi
PY="$(command -v "$PY" || echo "$PY")"

# A GPU? --no-gpu, no nvidia-smi, nvidia-smi listing none, or torch not seeing one: no.
# T3D_GPU_CHECK_ASSUME_GPU=1 runs the GPU steps anyway (to test this script's steps on a machine without a GPU:
# they then fail or skip where they need one).
NO_GPU_REASON=""
if [ "${T3D_GPU_CHECK_ASSUME_GPU:-0}" = 1 ]; then
  :
elif [ "$FORCE_NO_GPU" = 1 ]; then
  NO_GPU_REASON="--no-gpu given"
elif ! command -v nvidia-smi >/dev/null 2>&1; then
  NO_GPU_REASON="nvidia-smi not found"
elif ! nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then
  NO_GPU_REASON="nvidia-smi lists no GPU"
elif ! TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)' \
     >/dev/null 2>&1; then
  NO_GPU_REASON="torch.cuda.is_available() is False for $PY"
fi
if [ -z "$OUT" ]; then
  if [ -z "$NO_GPU_REASON" ]; then OUT="$ROOT/docs/benchmarks/gpu"; else OUT="$STATE"; fi
fi
mkdir -p "$OUT"
REPORT="$OUT/gpu-check-report.md"

# The nvidia-nccl-cu13 (or -cu12) wheel: its libnccl.so.2 (T3D_NCCL_LIBRARY, if torch has loaded none) and nccl.h
# (test_nccl_abi checks t3d's NCCL declarations against it).
NCCL_WHEEL="$(TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PY" - <<'EOF' 2>/dev/null || true
from importlib.metadata import PackageNotFoundError, files, version
for dist in ("nvidia-nccl-cu13", "nvidia-nccl-cu12"):
    try:
        fs = files(dist) or []
    except PackageNotFoundError:
        continue
    lib = next((str(f.locate()) for f in fs if f.name == "libnccl.so.2"), "")
    inc = next((str(f.locate().parent) for f in fs if f.name == "nccl.h"), "")
    print(f"{dist} {version(dist)}\t{lib}\t{inc}")
    break
EOF
)"
NCCL_WHEEL_NAME="$(printf '%s' "$NCCL_WHEEL" | cut -f1)"
NCCL_WHEEL_LIB="$(printf '%s' "$NCCL_WHEEL" | cut -f2)"
NCCL_WHEEL_INC="$(printf '%s' "$NCCL_WHEEL" | cut -f3)"

SITE="$BUILD/site"                # `cmake --install` of the build: the package as a wheel would hold it
GEN=""
command -v ninja >/dev/null 2>&1 && GEN=Ninja
export GEN ROOT BUILD PY JOBS CUDA_ARCHS CUDA_KERNELS TARGETS KIT SITE STATE NCCL_WHEEL_LIB NCCL_WHEEL_INC NO_GPU_REASON

STEPS=()
FAILED=()
# run_step NAME TIMEOUT_S FUNCTION [NEEDS...]: runs FUNCTION in its own bash (set -euo pipefail, under `timeout`),
# its output to logs/NAME.log. The function may write a one-line summary to $STEP_DETAIL, markdown to show in the
# report to $STEP_SHOW, and a reason to $STEP_SKIP (then the step counts as skipped). NEEDS: steps that must have
# passed first.
skip_step() {  # NAME REASON
  STEPS+=("$1"); echo skip >"$STATE/$1.status"; echo "$2" >"$STATE/$1.detail"; echo 0 >"$STATE/$1.secs"
  echo "== $1: skip: $2"
  write_report
}
run_step() {
  local name="$1" limit="$2" fn="$3"; shift 3
  if [ "${SKIP#*,"$name",}" != "$SKIP" ]; then skip_step "$name" "not selected (--skip)"; return 0; fi
  local need
  for need in "$@"; do
    if [ "$(cat "$STATE/$need.status" 2>/dev/null)" != pass ]; then
      skip_step "$name" "needs step '$need', which did not pass"; return 0
    fi
  done
  local own_limit="$limit"
  if [ "$DEADLINE" -gt 0 ]; then
    local left=$(( DEADLINE - ($(date +%s) - T0) - 20 ))
    if [ "$left" -lt 30 ]; then skip_step "$name" "out of time (--deadline $DEADLINE)"; return 0; fi
    [ "$left" -lt "$limit" ] && limit="$left"
  fi
  STEPS+=("$name")
  echo "== $name (at most ${limit}s)"
  export STEP_DETAIL="$STATE/$name.detail" STEP_SHOW="$STATE/$name.show" STEP_SKIP="$STATE/$name.skip"
  local log="$LOGS/$name.log" start rc
  : >"$STEP_DETAIL"; rm -f "$STEP_SHOW" "$STEP_SKIP"
  start=$(date +%s)
  set +e
  timeout -k 10 "$limit" bash -c "set -euo pipefail; $fn" >"$log" 2>&1 </dev/null
  rc=$?
  set -e
  echo $(( $(date +%s) - start )) >"$STATE/$name.secs"
  if { [ $rc -eq 124 ] || [ $rc -eq 137 ]; } && [ "$limit" -lt "$own_limit" ]; then
    # Stopped by --deadline before its own limit: not a verdict on the step (what it finished is in its section).
    echo skip >"$STATE/$name.status"
    echo "cut by --deadline $DEADLINE after ${limit}s (its own limit: ${own_limit}s); partial output in its log" \
      >"$STEP_DETAIL"
  elif [ $rc -eq 0 ] && [ -s "$STEP_SKIP" ]; then
    echo skip >"$STATE/$name.status"; cp "$STEP_SKIP" "$STEP_DETAIL"
  elif [ $rc -eq 0 ]; then
    echo pass >"$STATE/$name.status"
  else
    echo fail >"$STATE/$name.status"; FAILED+=("$name")
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
      echo "timed out after ${limit}s. $(cat "$STEP_DETAIL" 2>/dev/null)" >"$STEP_DETAIL"
    elif [ ! -s "$STEP_DETAIL" ]; then
      echo "exit status $rc" >"$STEP_DETAIL"
    fi
  fi
  echo "== $name: $(cat "$STATE/$name.status") ($(cat "$STATE/$name.secs")s) $(head -c 300 "$STEP_DETAIL" 2>/dev/null)"
  write_report
}

md_cell() { tr '\n' ' ' | sed 's/|/\\|/g; s/ *$//'; }
write_report() {
  local tmp="$REPORT.tmp" s st n_fail=0 n_pass=0 n_skip=0
  for s in "${STEPS[@]}"; do
    case "$(cat "$STATE/$s.status")" in pass) n_pass=$((n_pass + 1)) ;; fail) n_fail=$((n_fail + 1)) ;;
      *) n_skip=$((n_skip + 1)) ;; esac
  done
  {
    echo "# GPU check: $([ $n_fail -eq 0 ] && echo PASS || echo "FAIL ($n_fail failed)")"
    echo
    echo "\`scripts/gpu-check.sh\`, $(date -u +%Y-%m-%dT%H:%M:%SZ), $(( $(date +%s) - T0 )) s so far;" \
         "$n_pass passed, $n_fail failed, $n_skip skipped."
    echo
    [ -f "$STATE/env.md" ] && cat "$STATE/env.md"
    echo
    echo "| step | result | time | detail |"
    echo "| --- | --- | ---: | --- |"
    for s in "${STEPS[@]}"; do
      st="$(cat "$STATE/$s.status")"
      [ "$st" = skip ] && st="skip: $(md_cell <"$STATE/$s.detail")"
      if [ "${st%%:*}" = skip ]; then
        echo "| $s | $st | - | |"
      else
        echo "| $s | $st | $(cat "$STATE/$s.secs") s | $(md_cell <"$STATE/$s.detail" 2>/dev/null || true) |"
      fi
    done
    for s in "${STEPS[@]}"; do
      st="$(cat "$STATE/$s.status")"
      if [ -s "$STATE/$s.show" ] || [ "$st" = fail ]; then
        echo
        echo "## $s ($st)"
        if [ -s "$STATE/$s.show" ]; then echo; cat "$STATE/$s.show"; fi
        if [ "$st" = fail ]; then
          echo
          echo "Last 40 lines of its log:"
          echo
          echo '```'
          tail -n 40 "$LOGS/$s.log" | cut -c1-300
          echo '```'
        fi
      fi
    done
  } >"$tmp"
  mv "$tmp" "$REPORT"
}

# ---- the steps -----------------------------------------------------------------------------------------------------
step_env() {
  {
    local commit dirty
    if commit="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null)"; then
      dirty="$(git -C "$ROOT" status --porcelain --untracked-files=no | wc -l)"
      echo "- commit: \`$commit\` ($dirty modified tracked files)"
      # The device tool's copy of the tree can carry an older .git than the files: the kit says what was prepared.
      if [ -f "$KIT/kit.env" ] && ! grep -q "^COMMIT=$commit\$" "$KIT/kit.env"; then
        echo "- kit prepared at commit \`$(sed -n 's/^COMMIT=//p' "$KIT/kit.env")\`" \
             "($(sed -n 's/^DIRTY_FILES=//p' "$KIT/kit.env") modified tracked files then)"
      fi
    elif [ -f "$KIT/kit.env" ]; then
      echo "- commit: \`$(sed -n 's/^COMMIT=//p' "$KIT/kit.env")\` (no git here: the commit \`prepare\` recorded," \
           "$(sed -n 's/^DIRTY_FILES=//p' "$KIT/kit.env") modified tracked files then)"
    else
      echo "- commit: unknown (no git here, no kit)"
    fi
    if [ -n "$NO_GPU_REASON" ]; then
      echo "- mode: **no GPU** ($NO_GPU_REASON): kit check and build only"
    else
      echo "- mode: GPU"
      echo "- GPU (name, driver, memory, compute capability): $(nvidia-smi \
             --query-gpu=name,driver_version,memory.total,compute_cap --format=csv,noheader 2>&1 | head -n 4 \
             | tr '\n' ' ')"
    fi
    echo "- machine: $(cores) cores, $(uname -srm)"
    echo "- python: \`$PY\` ($("$PY" -c 'import platform; print(platform.python_version())' 2>&1))"
    TORCH_DEVICE_BACKEND_AUTOLOAD=0 "$PY" - <<'EOF' 2>&1 || echo "- torch: cannot import"
import os, sysconfig
import torch
nccl = "none"
try:
    nccl = ".".join(map(str, torch.cuda.nccl.version()))
except Exception as e:
    nccl = f"none ({type(e).__name__})"
print(f"- torch {torch.__version__}, built for CUDA {torch.version.cuda}, its NCCL {nccl}")
inc = sysconfig.get_paths()["include"]
print(f"- Python headers: {inc} ({'Python.h found' if os.path.exists(os.path.join(inc, 'Python.h')) else 'NO Python.h: the shim cannot build'})")
EOF
    echo "- NCCL wheel: ${NCCL_WHEEL_LIB:+$(printf '%s' "$NCCL_WHEEL_NAME"), libnccl }${NCCL_WHEEL_LIB:-none found}"
    echo "- nvcc: $( (nvcc --version 2>/dev/null | grep -o 'release [0-9.]*, V[0-9.]*') || echo none)"
    echo "- cmake $(cmake --version | head -n 1 | awk '{print $3}'), ninja $(ninja --version 2>/dev/null || echo none)," \
         "$(${CC:-cc} --version | head -n 1), CUDA archs $CUDA_ARCHS"
    echo "- build: \`$BUILD\` (T3D_WITH_UCX=OFF, CUDA kernels $([ "$CUDA_KERNELS" = 1 ] && echo on || echo off)${TARGETS:+, targets: $TARGETS})"
  } >"$STATE/env.md"
  cat "$STATE/env.md"
  echo "machine, versions and commit: above the table" >"$STEP_DETAIL"
}

step_kit() {
  if [ -f "$KIT/googletest/CMakeLists.txt" ]; then
    echo "GoogleTest sources: $KIT/googletest ($(sed -n 's/^GOOGLETEST=//p' "$KIT/kit.env" 2>/dev/null))" | tee "$STEP_DETAIL"
    echo "-DT3D_GTEST_SOURCE_DIR=$KIT/googletest" >"$STATE/gtest.args"
    echo "-DCMAKE_DISABLE_FIND_PACKAGE_GTest=ON" >>"$STATE/gtest.args"
    if ls "$KIT"/wheels/*.whl >/dev/null 2>&1; then
      rm -rf "$BUILD/kit-site"
      # The wheels are for the GPU machines' Python 3.12; elsewhere they may not install (only train-cuda needs them).
      if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$BUILD/kit-site" \
           "$KIT"/wheels/*.whl; then
        echo "; wheels into $BUILD/kit-site: $(cd "$KIT/wheels" && ls ./*.whl | sed 's|^\./||; s/-py.*//' | tr '\n' ' ')"
      else
        rm -rf "$BUILD/kit-site"
        echo "; the kit's wheels do not install for $PY (see the kit log)"
      fi | tee -a "$STEP_DETAIL"
    fi
    return 0
  fi
  # No kit: GoogleTest from the machine, if it has any; else the build goes on without the C tests.
  if [ -f /usr/src/googletest/CMakeLists.txt ]; then
    echo "-DT3D_GTEST_SOURCE_DIR=/usr/src/googletest" >"$STATE/gtest.args"
  elif ls /usr/include/gtest/gtest.h /usr/local/include/gtest/gtest.h >/dev/null 2>&1; then
    : >"$STATE/gtest.args"
  else
    echo "-DT3D_BUILD_TESTS=OFF" >"$STATE/gtest.args"
  fi
  echo "no kit at $KIT (run \`scripts/gpu-check.sh prepare\` on the Debian machine and carry .gpu-kit);" \
       "configure gets $(tr '\n' ' ' <"$STATE/gtest.args")" | tee "$STEP_DETAIL"
  return 1
}

cmake_args() {
  # CMAKE_POLICY_VERSION_MINIMUM: CMake 4 (pip's cmake) refuses projects that ask for less than 3.5.
  local a=(-S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DCMAKE_POLICY_VERSION_MINIMUM=3.5 -DT3D_PYTHON="$PY" -DT3D_WITH_UCX=OFF
           -DT3D_BUILD_SHIM=ON -DT3D_REQUIRE_SHIM=ON -DT3D_PY_INPLACE=OFF -DT3D_BUILD_TESTS=ON -DT3D_BUILD_BENCH=ON
           -DT3D_CUDA_ARCHS="$CUDA_ARCHS")
  [ "$CUDA_KERNELS" = 1 ] && a+=(-DT3D_BUILD_CUDA=ON) || a+=(-DT3D_BUILD_CUDA=OFF)
  [ -n "$NCCL_WHEEL_INC" ] && a+=(-DT3D_NCCL_INCLUDE_DIR="$NCCL_WHEEL_INC")
  local g
  while read -r g; do [ -n "$g" ] && a+=("$g"); done <"$STATE/gtest.args"
  printf '%s\n' "${a[@]}"
}
step_configure() {
  local args=()
  mapfile -t args < <(cmake_args)
  [ -n "$GEN" ] && [ ! -f "$BUILD/CMakeCache.txt" ] && args+=(-G "$GEN")
  echo "cmake ${args[*]}"
  # Torch's CMake otherwise probes the GPU (or guesses) for its own arch list; the kernels use T3D_CUDA_ARCHS.
  TORCH_CUDA_ARCH_LIST="$(echo "$CUDA_ARCHS" | sed 's/;/ /g; s/\([0-9]\)\([0-9]\)\b/\1.\2/g')" cmake "${args[@]}" 2>&1 \
    | tee "$STATE/configure.out"
  local cuda_line
  cuda_line="$(grep -E 't3d: (building the CUDA|no CUDA compiler|torch .* has no CUDA|CUDAToolkit not found)' \
               "$STATE/configure.out" | head -n 1 | sed 's/^-- //' || true)"
  local ucx_line
  ucx_line="$(grep -E 't3d: building without UCX' "$STATE/configure.out" | head -n 1 | sed 's/^-- //' || true)"
  local gtest_line
  gtest_line="$(grep -E 't3d: building GoogleTest' "$STATE/configure.out" | head -n 1 | sed 's/^-- //' || true)"
  echo "${ucx_line:-UCX?}; ${gtest_line:-GoogleTest installed}; ${cuda_line:-CUDA kernels off (T3D_BUILD_CUDA=OFF)}" \
    >"$STEP_DETAIL"
  return 0  # CUDA kernels not configured on a GPU machine: pytest-attention-cuda fails (nothing passes) and says why
}
step_build() {
  local t=()
  [ -n "$TARGETS" ] && read -r -a t <<<"$TARGETS" && t=(--target "${t[@]}")
  cmake --build "$BUILD" -j "$JOBS" "${t[@]}"
  echo "built ${TARGETS:-everything} with -j $JOBS" >"$STEP_DETAIL"
}
# After a failed build (a new compiler's warnings are errors in this build), once more without -Werror, so that
# the steps after it can still run; the build step stays failed.
step_build_nowerror() {
  cmake -S "$ROOT" -B "$BUILD" -DT3D_WERROR=OFF >/dev/null
  step_build
  echo "built with T3D_WERROR=OFF after the build with -Werror failed" >"$STEP_DETAIL"
}
step_stage() {
  rm -rf "$SITE"
  cmake --install "$BUILD" --prefix "$SITE"
  ls "$SITE/t3d"
  TORCH_DEVICE_BACKEND_AUTOLOAD=0 PYTHONPATH="$SITE" "$PY" - <<'EOF' | tee "$STEP_DETAIL"
import os, t3d, t3d.ops
info = t3d.build_info()
assert os.path.dirname(t3d.__file__) == os.path.join(os.environ["SITE"], "t3d"), t3d.__file__
assert not info["ucx"], info["features"]
print(f"import t3d from {os.environ['SITE']}: features {' '.join(f'{k}={v}' for k, v in info['features'].items())}; "
      f"cuda={info['cuda']}; CUDA kernels (t3d._C_cuda) {'loaded' if t3d.ops.CUDA_AVAILABLE else 'absent'}")
EOF
  # What the shim links against, and which C++ stream code it carries itself (a crash inside libstdc++'s number
  # formatting was seen here): for the report's stage section.
  local so
  for so in "$SITE"/t3d/_C.*so "$SITE"/t3d/_C_cuda*.so; do
    [ -f "$so" ] || continue
    { echo "$(basename "$so"): libstdc++ and torch as resolved (ldd):"; echo '```'
      ldd "$so" 2>&1 | grep -E 'stdc\+\+|gcc_s|c10|torch|not found' | head -n 12  || true
      echo "std::basic_ostream / num_put code defined in the module itself (nm):"
      nm -C --defined-only "$so" 2>/dev/null | grep -E 'basic_ostream<|num_put<' | head -n 8 || true
      echo '```'; } >>"$STEP_SHOW"
    # A module with a libstdc++ of its own beside torch's shared one crashes at its first ostream number formatting
    # (the GPU machines' gcc links libstdc++ statically by default; shim/CMakeLists.txt names it to prevent that).
    if command -v readelf >/dev/null && ! readelf -d "$so" | grep -q 'NEEDED.*libstdc++'; then
      echo "$(basename "$so") does not load the shared libstdc++ (it carries its own copy, which crashes beside" \
           "torch's): see T3D_SHARED_LIBSTDCXX in shim/CMakeLists.txt" | tee -a "$STEP_DETAIL"
      return 1
    fi
  done
  if [ "$CUDA_KERNELS" = 1 ] && ! ls "$SITE"/t3d/_C_cuda*.so >/dev/null 2>&1; then
    echo "(no t3d/_C_cuda*.so: the CUDA kernels were not built, see configure)" >>"$STEP_DETAIL"
  fi
}
py_env() { export PYTHONPATH="$SITE${KIT_SITE:+:$KIT_SITE}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=4; }
# A native crash in a Python step is reported with its C/C++ backtrace: scripts/crash_backtrace.c, built here with
# the machine's C compiler, is preloaded into the step's processes; symbolize_crash turns its module(+offset) frames
# into function names (addr2line) and appends them to the step's section of the report.
crash_preload() {
  local so="$BUILD/crash_backtrace.so"
  [ -f "$so" ] || cc -std=c11 -O1 -shared -fPIC -o "$so" "$ROOT/scripts/crash_backtrace.c" 2>/dev/null || return 0
  export LD_PRELOAD="$so${LD_PRELOAD:+:$LD_PRELOAD}"
}
symbolize_crash() {  # log file
  grep -q '==== t3d crash_backtrace' "$1" 2>/dev/null || return 0
  {
    echo
    echo "Native crash (scripts/crash_backtrace.c; frames as function @ file:line where addr2line knows them):"
    echo
    echo '```'
    awk '/==== t3d crash_backtrace/{on=1} on{print} /==== end of crash_backtrace/{on=0; if (++n == 2) exit}' "$1" |
      while IFS= read -r line; do
        if [[ "$line" =~ ^(/[^\(]+)\(\+(0x[0-9a-f]+)\) ]] && command -v addr2line >/dev/null; then
          echo "$line  ->  $(addr2line -f -C -p -e "${BASH_REMATCH[1]}" "${BASH_REMATCH[2]}" 2>/dev/null | head -c 300)"
        else
          echo "$line"
        fi
      done
    echo '```'
  } >>"$STEP_SHOW"
}
step_nccl() {
  py_env
  local rc=0
  crash_preload
  "$PY" "$ROOT/scripts/gpu_check_nccl.py" 2>"$STATE/nccl.err" | tee "$STEP_SHOW" || rc=$?
  cat "$STATE/nccl.err" >&2
  grep -v '^ *$' "$STEP_SHOW" | tail -n 1 >"$STEP_DETAIL" || true
  symbolize_crash "$STATE/nccl.err"
  return $rc
}
pytest_step() {  # pytest args...: fails unless something passed and nothing failed
  py_env
  local rc=0
  crash_preload
  # T3D_GPU_CHECK_PYTEST_ARGS: more pytest arguments for every pytest step (split at spaces);
  # T3D_GPU_CHECK_PYTEST_K: a -k expression (one argument, spaces allowed) for every pytest step.
  local k=()
  [ -n "${T3D_GPU_CHECK_PYTEST_K:-}" ] && k=(-k "$T3D_GPU_CHECK_PYTEST_K")
  # T3D_GPU_CHECK_PYTEST_WORKERS (4: on an H200 with 16 cores, 36 CUDA tests in 107 s): pytest-xdist workers when
  # the kit brought it (each test's ranks are processes of their own, with their own segments and file stores, so
  # tests can run side by side); 1: one after another.
  local workers="${T3D_GPU_CHECK_PYTEST_WORKERS:-4}"
  if [ "$workers" -gt 1 ] && "$PY" -c 'import xdist' >/dev/null 2>&1; then k+=(-n "$workers"); fi
  # shellcheck disable=SC2086
  (cd "$ROOT" && "$PY" -m pytest -q -rs --durations=8 -p no:cacheprovider "$@" "${k[@]}" ${T3D_GPU_CHECK_PYTEST_ARGS:-}) 2>&1 | tee "$STATE/pytest.out" || rc=$?
  grep -E '^(=+ )?[0-9]+ (passed|failed|skipped|error|deselected)' "$STATE/pytest.out" | tail -n 1 | sed 's/=//g' \
    >"$STEP_DETAIL" || echo "pytest exit status $rc" >"$STEP_DETAIL"
  grep -E '^SKIPPED' "$STATE/pytest.out" | head -n 20 | sed 's/^/    /' >"$STEP_SHOW" || true
  [ -s "$STEP_SHOW" ] && sed -i '1i Skipped:\n' "$STEP_SHOW"
  symbolize_crash "$STATE/pytest.out"
  [ $rc -eq 0 ] || return $rc
  grep -q ' passed' "$STEP_DETAIL" || { echo "nothing passed: $(cat "$STEP_DETAIL")" >"$STEP_DETAIL"; return 1; }
  # On a GPU machine a test skipped for want of a GPU (or of the CUDA kernels) is a failure of the check.
  if grep -E '^SKIPPED.*(no CUDA device|built without CUDA kernels)' "$STATE/pytest.out" >/dev/null; then
    echo "$(cat "$STEP_DETAIL"); but tests were skipped for want of a GPU or of the CUDA kernels" >"$STEP_DETAIL"
    return 1
  fi
}
step_pytest_cuda() { pytest_step tests/python/test_cuda.py; }
step_pytest_attention() { pytest_step tests/python/test_attention_ops.py -k cuda; }
step_bench() {
  py_env
  if "$PY" -m t3d.bench attention --help 2>&1 | grep -q -- '--device'; then
    "$PY" -m t3d.bench attention --device cuda --quick --out-dir "$STATE/bench-attention" | tee "$STATE/bench.out"
    echo "t3d-bench attention --device cuda --quick" >"$STEP_DETAIL"
  else
    # This tree's benchmark has no CUDA mode yet: run the CPU one (quick) so the step still says something.
    "$PY" -m t3d.bench attention --quick --no-save --threads "$JOBS" | tee "$STATE/bench.out"
    echo "\`t3d-bench attention\` has no --device option in this tree: ran the CPU benchmark" \
         "(--quick --threads $JOBS) instead" >"$STEP_DETAIL"
  fi
  # The whole output (the quick mode's is about 80 lines): a tail cut off its first rows.
  { echo '```'; cut -c1-400 "$STATE/bench.out"; echo '```'; } >"$STEP_SHOW"
}
step_bench_collectives() {
  # t3d through torch against NCCL on CUDA tensors, one rank per GPU (NCCL, and t3d's CUDA path with it, refuses
  # two ranks on one GPU).
  py_env
  local n
  n="$("$PY" -c 'import torch; print(torch.cuda.device_count())')"
  "$PY" -m t3d.bench collectives --device cuda --nproc "$n" --backends t3d,nccl \
    --ops all_reduce,broadcast,all_gather,reduce_scatter --max 64M --out "$STATE/bench-collectives" \
    --timeout 150 | tee "$STATE/bench-collectives.out"
  echo "t3d-bench collectives --device cuda --nproc $n --backends t3d,nccl --max 64M" >"$STEP_DETAIL"
  { echo '```'; grep -E '^(#|\|)' "$STATE/bench-collectives.out" | cut -c1-300 | tail -n 80; echo '```'; } >"$STEP_SHOW"
}
step_train_cuda() { pytest_step tests/python/test_train_cuda.py; }
mps_start() {  # a private MPS control daemon (its own pipe directory: only processes given it become clients)
  command -v nvidia-cuda-mps-control >/dev/null 2>&1 || { echo "no nvidia-cuda-mps-control on PATH"; return 1; }
  export CUDA_MPS_PIPE_DIRECTORY="$STATE/mps/pipe" CUDA_MPS_LOG_DIRECTORY="$STATE/mps/log"
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "nvidia-cuda-mps-control -d failed"; return 1; }
  sleep 1
}
mps_stop() {
  [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ] || return 0
  echo quit | nvidia-cuda-mps-control >/dev/null 2>&1 || true
  sleep 1
  tail -n 5 "$CUDA_MPS_LOG_DIRECTORY/control.log" 2>/dev/null | sed 's/^/mps control.log: /' || true
  unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
}
step_bench_collectives_shared() {
  # Ranks that share a GPU (NCCL refuses them), t3d alone: on its device path at every size (T3D_CUDA_PATH=ipc,
  # T3D_CUDA_IPC_MIN_BYTES=0; also with T3D_CUDA_IPC_WAIT=host, polled by the host instead of waited by the
  # stream) and staged through host memory; each also under MPS (one GPU context for all the ranks' processes,
  # instead of one context each, time-sliced), to see whether context switches are what a small call costs.
  # T3D_GPU_CHECK_SHARED_RUNS: the runs, "ranks:path:wait[:mps]" each; T3D_GPU_CHECK_SHARED_OPS: the ops. The default
  # five take about 120 s on an H200, which fit after the other steps inside --deadline 560 (2026-11-27: those took
  # 420 s); the runs it dropped (staged under MPS, the host's polling, 4 ranks without MPS) are in the reports of
  # docs/benchmarks/gpu/.
  py_env
  local runs="${T3D_GPU_CHECK_SHARED_RUNS:-2:ipc:device 2:ipc:device:mps 2:staged:device 4:ipc:device:mps \
8:ipc:device:mps}"
  local ops="${T3D_GPU_CHECK_SHARED_OPS:-all_reduce}"
  local run n path wait mps tag
  trap mps_stop EXIT
  trap 'mps_stop; exit 143' TERM INT
  for run in $runs; do
    IFS=: read -r n path wait mps <<<"$run"
    tag="$n-$path-$wait${mps:+-mps}"
    echo "== $n ranks, T3D_CUDA_PATH=$path, T3D_CUDA_IPC_WAIT=$wait${mps:+, under MPS}" \
      | tee -a "$STATE/bench-collectives-shared.out"
    if [ -n "$mps" ] && [ -z "${CUDA_MPS_PIPE_DIRECTORY:-}" ] && ! mps_start >>"$STATE/bench-collectives-shared.out" 2>&1; then
      echo "(MPS did not start: run skipped)" | tee -a "$STATE/bench-collectives-shared.out"
      continue
    fi
    # (mps_stop in this shell, not in a pipeline's subshell: it unsets the pipe directory the runs inherit)
    if [ -z "$mps" ] && [ -n "${CUDA_MPS_PIPE_DIRECTORY:-}" ]; then mps_stop >>"$STATE/bench-collectives-shared.out"; fi
    T3D_CUDA_PATH=$path T3D_CUDA_IPC_MIN_BYTES=0 T3D_CUDA_IPC_WAIT=$wait "$PY" -m t3d.bench collectives \
      --device cuda --nproc "$n" --backends t3d --ops "$ops" --max 16M \
      --out "$STATE/bench-collectives-shared-$tag" --timeout 120 | tee -a "$STATE/bench-collectives-shared.out" \
      || echo "(run $tag failed: exit status $?)" | tee -a "$STATE/bench-collectives-shared.out"
    # The section after each run, so a run cut by --deadline still reports what finished.
    { echo '```'; grep -E '^(#|\||Device|==|\(|mps)' "$STATE/bench-collectives-shared.out" | cut -c1-300 | tail -n 300
      echo '```'; } >"$STEP_SHOW"
  done
  mps_stop >>"$STATE/bench-collectives-shared.out"
  echo "t3d-bench collectives --device cuda --backends t3d --ops $ops --max 16M, ranks sharing a GPU:" \
       "$runs (ranks:T3D_CUDA_PATH:T3D_CUDA_IPC_WAIT[:under MPS])" >"$STEP_DETAIL"
  # The runs side by side (microseconds per call), ahead of the full tables.
  "$PY" - "$STATE" $runs >"$STATE/shared-summary.md" <<'PYEOF' || true
import json, os, sys
state, runs = sys.argv[1], [tuple((r + ":").split(":")[:4]) for r in sys.argv[2:]]
rows, have = {}, []
for n, path, wait, mps in runs:
    tag = f"{n}-{path}-{wait}" + ("-mps" if mps else "")
    f = os.path.join(state, f"bench-collectives-shared-{tag}", f"collectives-cuda-{n}ranks.json")
    if not os.path.exists(f):
        continue
    have.append((n, path, wait, mps))
    for r in json.load(open(f))["results"].get("t3d", []):
        rows.setdefault((r["op"], r["bytes"]), {})[have[-1]] = r["time_us"]
if rows:
    names = [f"{n} ranks {path}" + (" host waits" if wait == "host" else "") + (" MPS" if mps else "")
             for n, path, wait, mps in have]
    print("| op | bytes | " + " | ".join(names) + " |")
    print("|---|---:|" + "---:|" * len(have))
    for (op, b), v in sorted(rows.items()):
        print(f"| {op} | {b} | " + " | ".join(f"{v[k]:.1f}" if k in v else "-" for k in have) + " |")
PYEOF
  if [ -s "$STATE/shared-summary.md" ]; then
    { echo "Microseconds per call, each run at every size (T3D_CUDA_IPC_MIN_BYTES=0):"; echo
      cat "$STATE/shared-summary.md"; echo; cat "$STEP_SHOW"; } >"$STEP_SHOW.tmp" && mv "$STEP_SHOW.tmp" "$STEP_SHOW"
  fi
}
step_ctest() {
  # No C test loads the real libnccl today (the fakes set T3D_NCCL_LIBRARY themselves, test_nccl_missing gets its
  # own from ctest); any that does gets the wheel's library.
  [ -n "$NCCL_WHEEL_LIB" ] && export T3D_NCCL_LIBRARY="$NCCL_WHEEL_LIB"
  local rc=0
  # T3D_GPU_CHECK_CTEST_ARGS: more ctest arguments (e.g. -R to select tests).
  # shellcheck disable=SC2086
  ctest --test-dir "$BUILD" --output-on-failure -j 4 --timeout 300 ${T3D_GPU_CHECK_CTEST_ARGS:-} | tee "$STATE/ctest.out" || rc=$?
  { grep -E 'tests passed|tests failed' "$STATE/ctest.out" | tail -n 1
    echo "; skipped: $(grep -c -E '\*\*\*Skipped|Not Run' "$STATE/ctest.out" || true)"; } | tr -d '\n' >"$STEP_DETAIL"
  grep -E '\*\*\*Failed|\*\*\*Skipped|\*\*\*Timeout|Not Run' "$STATE/ctest.out" | sed 's/^/    /' >"$STEP_SHOW" || true
  return $rc
}
export -f cores step_env step_kit cmake_args step_configure step_build step_build_nowerror step_stage py_env step_nccl \
  crash_preload symbolize_crash \
  pytest_step step_pytest_cuda step_pytest_attention step_bench step_bench_collectives step_train_cuda \
  step_bench_collectives_shared mps_start mps_stop step_ctest
export NCCL_WHEEL_NAME

run_step env 120 step_env
run_step kit 60 step_kit
[ -d "$BUILD/kit-site" ] && KIT_SITE="$BUILD/kit-site" && export KIT_SITE
[ -f "$STATE/gtest.args" ] || : >"$STATE/gtest.args"
run_step configure 300 step_configure
run_step build 1200 step_build configure
if [ "$(cat "$STATE/build.status")" = fail ]; then
  run_step build-no-werror 900 step_build_nowerror configure
  BUILT=build-no-werror
else
  BUILT=build
fi
run_step stage 180 step_stage "$BUILT"
# The tests first (the C tests are quick), the benchmarks last: a --deadline that runs out skips benchmarks.
GPU_STEPS=(ctest nccl-1rank pytest-cuda pytest-attention-cuda train-cuda bench-attention bench-collectives
           bench-collectives-shared)
if [ -n "$NO_GPU_REASON" ]; then
  for s in "${GPU_STEPS[@]}"; do skip_step "$s" "no GPU ($NO_GPU_REASON)"; done
else
  run_step ctest 900 step_ctest "$BUILT"
  run_step nccl-1rank 240 step_nccl stage
  run_step pytest-cuda 600 step_pytest_cuda stage
  run_step pytest-attention-cuda 300 step_pytest_attention stage
  run_step train-cuda 420 step_train_cuda stage
  run_step bench-attention 240 step_bench stage
  run_step bench-collectives 200 step_bench_collectives stage
  run_step bench-collectives-shared 360 step_bench_collectives_shared stage
fi

write_report
if [ "$OUT_GIVEN" = 1 ]; then
  tar -C "$STATE" -czf "$OUT/gpu-check-logs.tar.gz" logs
fi
echo "report: $REPORT"
if [ ${#FAILED[@]} -gt 0 ]; then
  echo "gpu-check.sh: failed: ${FAILED[*]}" >&2
  exit 1
fi
