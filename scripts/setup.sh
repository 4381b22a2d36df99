#!/usr/bin/env bash
# Idempotent setup for a fresh machine: Debian packages, the project virtualenv (outside the clone, keyed by the
# hash of its requirements file), and the build. Prints the venv path on its last line.
#   scripts/setup.sh                  the newest stack (requirements.txt) and the developer build into build/
#   scripts/setup.sh --stack oldest   the oldest stack's venv (requirements-oldest.txt) only: scripts/test.sh builds
#                                     and installs a wheel into it (a developer build there would share python/t3d/)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[setup] %s\n' "$*" >&2; }
REQ="$ROOT/requirements.txt"
if [ "${1:-}" = "--stack" ]; then
  case "${2:-}" in
    newest) ;;
    oldest) REQ="$ROOT/requirements-oldest.txt"; T3D_SKIP_BUILD=1 ;;
    *) echo "setup.sh: --stack takes newest or oldest, not '${2:-}'" >&2; exit 2 ;;
  esac
fi

# 1. Debian packages. Only missing ones are installed; apt needs root (or sudo).
DEB_PKGS=(build-essential cmake pkg-config libucx-dev ucx-utils googletest libgtest-dev python3-venv ccache)
missing=()
for p in "${DEB_PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q 'install ok installed' || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  $SUDO apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${missing[@]}" >&2
fi

# 2. The virtualenv, keyed by the requirements hash so that a change of pins builds a new one.
HASH="$(sha256sum "$REQ" | cut -c1-12)"
VENV="${T3D_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/t3d/venv-$HASH}"
if [ ! -f "$VENV/.complete" ]; then
  log "creating virtualenv $VENV (torch is a large download; this happens once per requirements hash)"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  PY="${T3D_PYTHON:-python3}"
  "$PY" -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q --upgrade pip setuptools wheel >&2
  "$VENV/bin/pip" install -q -r "$REQ" >&2
  touch "$VENV/.complete"
fi

"$ROOT/scripts/ensure-skbuild.sh" "$VENV" >&2


# 3. The build: C library, tests, shim and the Python package (editable, against the installed torch; build.sh also
#    installs the build backend, scikit-build-core, into the venv when it is missing).
if [ "${T3D_SKIP_BUILD:-0}" != 1 ]; then
  "$ROOT/scripts/build.sh" "$VENV" >&2
fi
echo "$VENV"
