#!/usr/bin/env bash
# t3d-bench from a fresh clone: setup (packages, virtualenv, build), then `t3d-bench` with the arguments given, e.g.
#   ./scripts/bench.sh collectives --nproc 2            # t3d, gloo and (if installed) Open MPI, 8 B .. 256 MiB
#   ./scripts/bench.sh collectives --nproc 8 --max 16M
#   ./scripts/bench.sh attention --seqs 512 2048
# The Open MPI peer needs ./scripts/install-mpi-peer.sh once; without it the bench names it and skips it.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$("$ROOT/scripts/setup.sh" | tail -n 1)"
exec "$VENV/bin/python" -m t3d.bench "$@"
