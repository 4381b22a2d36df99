#!/usr/bin/env bash
# Builds the C library, its tests and the torch shim against the venv's torch, then installs the Python package
# (editable, no build isolation). Usage: scripts/build.sh VENV [extra cmake args]
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$1"; shift || true
BUILD="${T3D_BUILD_DIR:-$ROOT/build}"
JOBS="$(nproc)"
cmake -S "$ROOT" -B "$BUILD" -DCMAKE_BUILD_TYPE=RelWithDebInfo -DT3D_BUILD_SHIM=ON -DT3D_BUILD_TESTS=ON \
  -DT3D_PYTHON="$VENV/bin/python" "$@" >/dev/null
cmake --build "$BUILD" -j "$JOBS"
# The shim and libt3d land next to the Python sources (python/t3d/), where the package loads them.
# (Re)install the editable package when it is missing or pyproject.toml (entry points, scripts) changed.
STAMP="$BUILD/.pip-install-$(sha256sum "$ROOT/pyproject.toml" | cut -c1-12)"
if [ ! -f "$STAMP" ] || ! "$VENV/bin/python" -c 'import importlib.metadata as m; m.distribution("t3d")' >/dev/null 2>&1; then
  "$VENV/bin/pip" install -q --no-build-isolation --no-deps -e "$ROOT"
  touch "$STAMP"
fi
