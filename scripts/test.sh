#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates .venv, installs everything, then lint, types, layers and pytest.
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
"$PY" -m ruff check weightcache tests scripts  # rules and line length: [tool.ruff] in pyproject.toml
"$PY" -m mypy  # --strict on the package: [tool.mypy] in pyproject.toml
"$VENV/bin/lint-imports"  # the layers of docs/architecture.md: [tool.importlinter] in pyproject.toml
# One worker more than the CPUs (tests also wait on sockets and subprocesses: on 2 cores, 3 workers took 332-340 s
# where 2 took 392 s); WEIGHTCACHE_TEST_WORKERS=0 runs in this process (pdb, -s). Each worker starts its own moto
# server and temp dirs; tests share nothing else.
workers="${WEIGHTCACHE_TEST_WORKERS:-$(( $(nproc) + 1 ))}"
exec "$PY" -m pytest -n "$workers" --dist worksteal "$@"  # worksteal: the long transformers loads do not end last
