#!/usr/bin/env bash
# The main job: setup, then the demo on CPU with its embedded defaults.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$("$ROOT/scripts/setup.sh" | tail -n 1)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m t3d.demo "$@"
