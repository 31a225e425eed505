#!/usr/bin/env bash
# Run the whole test suite on a fresh machine: creates .venv, installs everything, then lint, types, layers and pytest.
#   scripts/test.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
# Bytecode once, on the core mypy leaves idle: the package's (every CLI, daemon and CSI subprocess a test starts
# would otherwise compile it from source) and pytest's assertion-rewritten test modules (each worker would otherwise
# rewrite all of them: half of a worker's 20 CPU seconds of collection). PYTHONDONTWRITEBYTECODE, where the
# environment sets it, would keep both from being written.
unset PYTHONDONTWRITEBYTECODE
( "$PY" -m compileall -q weightcache >/dev/null && "$PY" -m pytest --collect-only -q -p no:xdist >/dev/null ) &
warm=$!
"$PY" -m ruff check weightcache tests scripts  # rules and line length: [tool.ruff] in pyproject.toml
"$PY" -m mypy  # --strict on the package: [tool.mypy] in pyproject.toml
"$VENV/bin/lint-imports"  # the layers of docs/architecture.md: [tool.importlinter] in pyproject.toml
"$PY" scripts/import_graph.py  # and no import circle, even inside a layer (exit 1 on one)
wait "$warm" || true  # a module that fails to collect is reported by the run below, with its traceback
# Two workers more than the CPUs: most of a test's time is waiting (sockets, subprocesses, timeouts a test lets run
# out); the suite needs about 240 CPU seconds, and on 2 cores 3 workers kept them 40% busy (session 54, 2310 tests:
# 300 s with 3 workers at load 22-7, 280 s with 4 at load 9-6; 9789fa3's suite: 392 s with 2, 332-340 s with 3).
# WEIGHTCACHE_TEST_WORKERS=0 runs in this process (pdb, -s). Each worker starts its own moto server and temp dirs;
# tests share nothing else.
workers="${WEIGHTCACHE_TEST_WORKERS:-$(( $(nproc) + 2 ))}"
exec "$PY" -m pytest -n "$workers" --dist worksteal "$@"  # worksteal: the long transformers loads do not end last
