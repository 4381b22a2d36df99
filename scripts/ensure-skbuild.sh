#!/usr/bin/env bash
# Installs the build backend of `pip install .` / `pip wheel .` (scikit-build-core, pyproject.toml) into a venv when it
# is missing: --no-build-isolation takes it from there. It is not pinned in requirements*.txt, whose hashes name the
# venvs (a new pin there would mean a new venv and another torch download). Usage: scripts/ensure-skbuild.sh VENV
set -euo pipefail
VENV="$1"
SKBUILD_CORE_VERSION=1.1.2
if ! "$VENV/bin/python" -I -c 'import sys
from importlib.metadata import version
sys.exit(int(version("scikit-build-core").split(".")[0]) < 1)' 2>/dev/null; then
  "$VENV/bin/pip" install -q "scikit-build-core==$SKBUILD_CORE_VERSION"
fi
