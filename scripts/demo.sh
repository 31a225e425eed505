#!/usr/bin/env bash
# The main job end to end on an embedded default: a local S3 server on 127.0.0.1, a small real safetensors model,
# `weightcache prefetch` into a store under a temp root, `weightcache ls`, load it back, print a report.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
exec "$PY" scripts/demo.py "$@"
