#!/usr/bin/env bash
# The main job: setup, then the 3D-parallel training demo on CPU with its embedded defaults
# (tiny Llama from a config, generated text; dp 2 x tp 2 x cp 2 = 8 ranks on backend t3d). Extra arguments go to
# t3d-train (e.g. --steps 20, --dp 1 --tp 2 --cp 1).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$("$ROOT/scripts/setup.sh" | tail -n 1)"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec "$VENV/bin/python" -m t3d.train "$@"
