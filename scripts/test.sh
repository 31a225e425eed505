#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates .venv, installs everything, runs pytest.
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
exec "$PY" -m pytest "$@"
