#!/usr/bin/env bash
# Optional: Open MPI (Debian) and mpi4py (PyPI, pinned) for `t3d-bench collectives --backends ...,mpi`. Not needed
# by the build or the tests; the bench skips the mpi peer by name when it is absent.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$(T3D_SKIP_BUILD=1 "$ROOT/scripts/setup.sh")"
SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq openmpi-bin libopenmpi-dev >&2
"$VENV/bin/pip" install -q "mpi4py==4.1.2"
"$VENV/bin/python" -c "from mpi4py import MPI; print('mpi4py', MPI.Get_library_version().splitlines()[0])"
