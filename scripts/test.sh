#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates .venv, installs everything, runs pytest.
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${WEIGHTCACHE_VENV:-.venv}"
PY=python3
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --disable-pip-version-check --upgrade pip
# torch first and exactly: the CPU build on this disk; a bare `torch` requirement would pull a multi-GB CUDA build.
"$VENV/bin/python" -m pip install -q --disable-pip-version-check torch==2.13.0
"$VENV/bin/python" -m pip install -q --disable-pip-version-check -e '.[dev,torch]'
# util-linux gives mount/umount/findmnt for the CSI and ENOSPC tests (present on Debian; make sure).
if ! command -v findmnt >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq util-linux mount >/dev/null
fi
exec "$VENV/bin/python" -m pytest "$@"
