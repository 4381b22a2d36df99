#!/usr/bin/env bash
# Builds the C library, its tests and the torch shim against the venv's torch, and installs the Python package
# (editable, no build isolation). Usage: scripts/build.sh VENV [extra cmake args]
#
# The developer build is one CMake build, into build/ (tests and benchmarks included, for ctest and tests/python),
# which writes the modules and the libraries they load into python/t3d/. The editable install only registers the
# source tree (python/ on sys.path, the "torch.backends" entry point, the scripts) and runs no CMake: pyproject.toml's
# override for editable installs. A wheel (`pip wheel . --no-build-isolation`) is built separately by
# scikit-build-core, without tests or benchmarks (tests/python/test_wheel.py).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$1"; shift || true
BUILD="${T3D_BUILD_DIR:-$ROOT/build}"
. "$ROOT/scripts/ccache-env.sh"
JOBS="$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)"  # GNU nproc honours OMP_NUM_THREADS, not a build limit

# The venv is shared by every clone on this machine (it is keyed by requirements.txt only), so its editable install
# may point at another clone, or at one since deleted: then `import torch` fails (torch loads the "torch.backends"
# entry point t3d_autoload from there) and so would CMake's torch probe. (Re)install it first whenever it does not
# point at this clone or pyproject.toml (entry points, scripts) changed. `-I` keeps the current directory and
# PYTHONPATH out of the answer.
installed_from() {
  "$VENV/bin/python" -I -c 'import os, t3d_autoload; print(os.path.dirname(os.path.realpath(t3d_autoload.__file__)))' \
    2>/dev/null || true
}
"$ROOT/scripts/ensure-skbuild.sh" "$VENV"

mkdir -p "$BUILD"
STAMP="$BUILD/.pip-install-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-12)"
if [ ! -f "$STAMP" ] || [ "$(installed_from)" != "$(realpath "$ROOT/python")" ]; then
  "$VENV/bin/pip" install -q --no-build-isolation --no-deps -e "$ROOT"
  # scikit-build-core's editable hook puts a finder at the front of sys.meta_path, ahead of PYTHONPATH: another tree
  # (an installed copy under test, another clone) could then never be imported instead. A plain path entry, as a
  # setuptools editable install had, serves the same sources after PYTHONPATH.
  SITE="$("$VENV/bin/python" -I -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  echo "$(realpath "$ROOT/python")" >"$SITE/_editable_skbc_t3d.pth"
  touch "$STAMP"
fi

cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DT3D_BUILD_SHIM=ON -DT3D_BUILD_TESTS=ON -DT3D_PY_INPLACE=ON \
  -DT3D_PYTHON="$VENV/bin/python" "$@" >/dev/null
# The shim and libt3d land next to the Python sources (python/t3d/), where the package loads them.
cmake --build "$BUILD" -j "$JOBS"
