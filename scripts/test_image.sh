#!/usr/bin/env bash
# The image tier (README.md; .ci/run runs it after the main suite): build the project's Dockerfile and run the image
# the way deploy/daemonset runs it, without Docker and without a container registry.
#
#   - the base: the pinned python:3.11-slim-bookworm when it can be pulled, else Debian bookworm + python3 made with
#     debootstrap (cached under $WEIGHTCACHE_IMAGE_CACHE, default /var/cache/weightcache-image);
#   - the wheels: requirements.lock downloaded once from PyPI into the cache (hashes checked), passed to the build
#     as a wheelhouse through the Dockerfile's PIP_NO_INDEX/PIP_FIND_LINKS build args;
#   - `buildah bud --timestamp 0 --layers` (later runs reuse unchanged steps), then once more without the cache:
#     the same image ID both times (WEIGHTCACHE_IMAGE_REPRO=0 skips the second build);
#   - podman with runc, `--network host`, the ulimits a VM's root may set; the node image privileged with the host
#     mounts (the kubelet directory rshared, as the DaemonSet's Bidirectional mount), the webhook as 65532 on a
#     read-only root; and checks: `weightcache version`; the daemon as PID 1 answers its API socket and CSI
#     Identity/Node; a prefetch from an S3 server on the host through the daemon; a CSI publish the HOST sees
#     ro,nosuid,nodev; SIGTERM ends it with exit 0 within the grace period, the mount kept and adopted by the next
#     start; the webhook answers an AdmissionReview over TLS; `uninstall-node` dry run.
#   - prints the build time, the image size by layer, the daemon's idle RSS; writes build/image/sbom.cdx.json, a
#     CycloneDX SBOM of the Python packages (cyclonedx-bom from PyPI; the Debian base is not in it: the release
#     workflow's BuildKit SBOM covers both).
#
# Needs root (mounts, podman) and .venv (scripts/test.sh makes it). Installs the Debian tools it lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH=$PWD
PY=${WEIGHTCACHE_VENV:-.venv}/bin/python
CACHE=${WEIGHTCACHE_IMAGE_CACHE:-/var/cache/weightcache-image}
PINNED_BASE=docker.io/library/python:3.11.14-slim-bookworm
LOCAL_BASE=localhost/weightcache-base:bookworm-python3
IMAGE=localhost/weightcache:image-tier
GRACE=30  # the DaemonSet's terminationGracePeriodSeconds
PODMAN=(podman --runtime runc)
RUN=(--ulimit nofile=1024:1024 --ulimit nproc=1024:1024 --network host)
say() { printf '\n== %s\n' "$*"; }
since() { awk -v a="$1" -v b="$EPOCHREALTIME" 'BEGIN { printf "%.1f", b - a }'; }  # seconds since $1
fail() { echo "FAIL: $*" >&2; exit 1; }

tools=()
for t in debootstrap:debootstrap buildah:buildah podman:podman runc:runc; do
  command -v "${t%%:*}" >/dev/null || tools+=("${t#*:}")
done
if [ ${#tools[@]} -gt 0 ]; then
  say "installing ${tools[*]}"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${tools[@]}" >/dev/null
fi
mkdir -p "$CACHE"

base_image() {
  if timeout 60 podman pull -q "$PINNED_BASE" >/dev/null 2>&1; then echo "$PINNED_BASE"; return; fi
  if ! podman image exists "$LOCAL_BASE"; then
    if [ ! -s "$CACHE/base.tar" ]; then
      rm -rf "$CACHE/rootfs"
      nice -n 19 debootstrap --variant=minbase --include=python3,python3-venv bookworm "$CACHE/rootfs" \
        http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 || { tail "$CACHE/debootstrap.log"; exit 1; }
      rm -rf "$CACHE"/rootfs/var/cache/apt/archives/*.deb "$CACHE"/rootfs/var/lib/apt/lists/*
      tar --numeric-owner -C "$CACHE/rootfs" -cf "$CACHE/base.tar.tmp" . && mv "$CACHE/base.tar.tmp" "$CACHE/base.tar"
      rm -rf "$CACHE/rootfs"
    fi
    podman import -q --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' "$CACHE/base.tar" "$LOCAL_BASE" >/dev/null
  fi
  echo "$LOCAL_BASE"
}

say "base image"
BASE=$(base_image)
echo "$BASE (the pinned $PINNED_BASE $([ "$BASE" = "$PINNED_BASE" ] && echo pulled || echo 'cannot be pulled here'))"

say "wheelhouse (requirements.lock, hashes checked)"
WHEELS="$CACHE/wheelhouse"
LOCKS=$(cat requirements.lock requirements-build.lock | sha256sum | cut -c1-16)
if [ ! -e "$WHEELS/.complete-$LOCKS" ]; then  # pip asks the index again even when every file is there: once per lock
  "$PY" -m pip download -q --disable-pip-version-check --only-binary :all: --require-hashes -d "$WHEELS" \
    -r requirements.lock -r requirements-build.lock 2>"$CACHE/pip.log" || { cat "$CACHE/pip.log"; fail "pip download"; }
  touch "$WHEELS/.complete-$LOCKS"
fi
ls "$WHEELS" | wc -l | xargs echo "wheels:"

build() {  # TAG [buildah options]; the unset build args (PIP_INDEX_URL, PIP_CERT) are warned about: not shown
  local tag=$1; shift
  buildah bud -q --timestamp 0 --isolation chroot --layers "$@" --build-arg "PYTHON_IMAGE=$BASE" \
    --build-arg PIP_NO_INDEX=1 --build-arg PIP_FIND_LINKS=/wheelhouse -v "$WHEELS:/wheelhouse:ro" \
    -t "$tag" . 2> >(grep -v 'missing .* build argument' >&2) | tail -1
}
say "buildah bud --timestamp 0"
start=$EPOCHREALTIME
ID=$(build "$IMAGE")
echo "image $ID built in $(since "$start") s"
if [ "${WEIGHTCACHE_IMAGE_REPRO:-1}" = 1 ]; then
  ID2=$(build "$IMAGE-again" --no-cache)
  podman rmi -f "$IMAGE-again" >/dev/null 2>&1 || true
  [ "$ID" = "$ID2" ] || fail "two builds gave two image IDs: $ID $ID2"
  echo "a second build gave the same image ID"
fi

say "size by layer"
podman history --format '{{.Size}}\t{{.CreatedBy}}' "$IMAGE" | cut -c1-150
podman image inspect -f 'total {{.Size}} bytes' "$IMAGE"

WORK=$(mktemp -d /tmp/wc-image.XXXXXX)
S3_PID=
cleanup_containers() { for c in wc-image-daemon wc-image-webhook; do "${PODMAN[@]}" rm -f -t 0 "$c" >/dev/null 2>&1 || true; done; }
cleanup() {
  cleanup_containers
  [ -n "$S3_PID" ] && kill "$S3_PID" 2>/dev/null && wait "$S3_PID" 2>/dev/null
  umount -R "$WORK/kubelet" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT

cleanup_containers  # a run killed before its trap
say "weightcache version"
"${PODMAN[@]}" run --rm "${RUN[@]}" "$IMAGE" version

# the host: a kubelet directory of its own, shared like a node's (systemd makes / shared)
mkdir -p "$WORK"/{kubelet,store,run,csi,etc,tls}
mount -t tmpfs -o size=16m wc-image-kubelet "$WORK/kubelet"
mount --make-shared "$WORK/kubelet"
echo "{}" >"$WORK/etc/config.yaml"
"$PY" scripts/image_probe.py s3 "$WORK/s3-endpoint" >"$WORK/s3.log" 2>&1 & S3_PID=$!
for _ in $(seq 100); do [ -s "$WORK/s3-endpoint" ] && break; sleep 0.2; done
ENDPOINT=$(cat "$WORK/s3-endpoint")

start_daemon() {
  "${PODMAN[@]}" run -d --name wc-image-daemon --privileged "${RUN[@]}" \
    -e NODE_NAME=image-node -e PYTHONDONTWRITEBYTECODE=1 -e AWS_ENDPOINT_URL="$ENDPOINT" \
    -e AWS_ACCESS_KEY_ID=testing -e AWS_SECRET_ACCESS_KEY=testing -e AWS_DEFAULT_REGION=us-east-1 \
    --mount "type=bind,src=$WORK/kubelet,dst=/var/lib/kubelet,bind-propagation=rshared" \
    -v "$WORK/csi:/csi" -v "$WORK/store:/var/lib/weightcache" -v "$WORK/run:/run/weightcache" \
    -v "$WORK/etc:/etc/weightcache:ro" "$IMAGE" \
    daemon --config /etc/weightcache/config.yaml --csi-endpoint unix:///csi/csi.sock \
    --root /var/lib/weightcache --socket /run/weightcache/weightcache.sock >/dev/null
  for _ in $(seq 150); do [ -S "$WORK/csi/csi.sock" ] && [ -S "$WORK/run/weightcache.sock" ] && return; sleep 0.1; done
  "${PODMAN[@]}" logs wc-image-daemon | tail -20; fail "the daemon did not open its sockets"
}
say "the node image, as the DaemonSet runs it"
start=$EPOCHREALTIME
start_daemon
echo "sockets up in $(since "$start") s"
PID=$("${PODMAN[@]}" inspect -f '{{.State.Pid}}' wc-image-daemon)
grep NSpid "/proc/$PID/status" | awk '{exit !($NF == 1)}' || fail "the daemon is not PID 1 in its container"
tr '\0' ' ' <"/proc/$PID/cmdline" | xargs echo "PID 1:"
"$PY" -m weightcache ls --socket "$WORK/run/weightcache.sock" -o json >/dev/null || fail "the API socket did not answer"
echo "the API socket answers (weightcache ls)"

say "prefetch through the daemon from S3 on the host ($ENDPOINT)"
"$PY" -m weightcache prefetch s3://models/tiny/ --socket "$WORK/run/weightcache.sock" -q

say "CSI over the plugin socket"
POD=pods/image-tier-vol/volumes/kubernetes.io~csi/model/mount
"$PY" scripts/image_probe.py csi "$WORK/csi/csi.sock" "/var/lib/kubelet/$POD" s3://models/tiny/
"$PY" scripts/image_probe.py readonly "$WORK/kubelet/$POD" || fail "the host does not see the volume ro,nosuid,nodev"

sleep 5
say "idle RSS"
grep VmRSS "/proc/$PID/status"

say "SIGTERM (grace ${GRACE}s)"
start=$EPOCHREALTIME
"${PODMAN[@]}" stop -t "$GRACE" wc-image-daemon >/dev/null
took=$(since "$start")
code=$("${PODMAN[@]}" inspect -f '{{.State.ExitCode}}' wc-image-daemon)
echo "exit $code after $took s"
[ "$code" = 0 ] || fail "the daemon exited $code on SIGTERM"
awk -v t="$took" -v g="$GRACE" 'BEGIN { exit !(t < g) }' || fail "SIGTERM took the whole grace period"
"$PY" scripts/image_probe.py readonly "$WORK/kubelet/$POD" || fail "the mount did not survive the daemon's exit"
"${PODMAN[@]}" rm wc-image-daemon >/dev/null
start_daemon
"$PY" scripts/image_probe.py unpublish "$WORK/csi/csi.sock" "/var/lib/kubelet/$POD"
"${PODMAN[@]}" stop -t "$GRACE" wc-image-daemon >/dev/null

say "uninstall-node (dry run)"
"${PODMAN[@]}" run --rm --privileged "${RUN[@]}" -v "$WORK/store:/var/lib/weightcache" \
  -v "$WORK/run:/run/weightcache" --mount "type=bind,src=$WORK/kubelet,dst=/var/lib/kubelet,bind-propagation=rshared" \
  "$IMAGE" uninstall-node --root /var/lib/weightcache --kubelet-dir /var/lib/kubelet --run-dir /run/weightcache
[ -d "$WORK/store/blobs" ] || fail "the dry run removed the store"

say "the webhook, as its Deployment runs it (65532, read-only root, no capabilities)"
"${PODMAN[@]}" run --rm "${RUN[@]}" -v "$WORK/tls:/out" "$IMAGE" \
  webhook certs --service weightcache-webhook --namespace weightcache --out /out >/dev/null
chown -R 65532:65532 "$WORK/tls"
PORT=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"${PODMAN[@]}" run -d --name wc-image-webhook --user 65532:65532 --read-only --cap-drop ALL \
  --security-opt no-new-privileges "${RUN[@]}" -v "$WORK/tls:/tls:ro" "$IMAGE" \
  webhook --cert /tls/tls.crt --key /tls/tls.key --port "$PORT" --host 127.0.0.1 >/dev/null
for i in $(seq 50); do
  "$PY" scripts/image_probe.py admission "$PORT" "$WORK/tls/ca.crt" 2>/dev/null && break
  [ "$i" = 50 ] && { "${PODMAN[@]}" logs wc-image-webhook | tail; fail "the webhook did not answer"; }
  sleep 0.2
done

say "SBOM of the Python packages (CycloneDX, from requirements.lock: exactly what the image's venv installs)"
"$PY" -c 'import cyclonedx_py' 2>/dev/null \
  || "$PY" -m pip install -q --disable-pip-version-check 'cyclonedx-bom>=7,<8' 2>"$WORK/pip.log" \
  || { cat "$WORK/pip.log"; fail "pip install cyclonedx-bom"; }
mkdir -p build/image
"$PY" -m cyclonedx_py requirements requirements.lock --of JSON -o build/image/sbom.cdx.json 2>/dev/null
"$PY" -c 'import json, sys; d = json.load(open(sys.argv[1])); print(sys.argv[1], len(d["components"]), "components")' \
  build/image/sbom.cdx.json

say "image tier passed"
