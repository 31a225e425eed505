"""The DRA device metadata file (KEP-5304; alpha in Kubernetes 1.36, beta in 1.37): what a container reads about
the model it was given, beside `WEIGHTCACHE_MODEL_PATH`.

The protocol is the driver's to implement (kubelet writes nothing; the Go kubelet-plugin library does it for Go
drivers): one file per claim, top-level request and driver, bind-mounted read-only into the containers that use
the request (through the same CDI device that mounts the model), at

    /var/run/kubernetes.io/dra-device-attributes/resourceclaims/<claim name>/<request>/<driver>-metadata.json
    /var/run/kubernetes.io/dra-device-attributes/resourceclaimtemplates/<pod claim>/<request>/<driver>-metadata.json

(`<driver>-metadata.json` is `models.weightcache.io-metadata.json`),

the second for a claim made from a ResourceClaimTemplate (the resourceclaim controller's annotation
`resource.kubernetes.io/pod-claim-name` names it: `pod.spec.resourceClaims[].name`). With a prioritized list the
path has the top-level request only and the file's `requests[].name` carries `<request>/<subrequest>`.

The file is a stream of `DeviceMetadata` objects, the same content once per API version, newest first
(`metadata.resource.k8s.io/v1beta1`, then `v1alpha1` for older readers); a reader takes the first it can decode.
`metadata.generation` is 1: the file is written once, at prepare, and never changes while the container runs.
Device attributes use the ResourceSlice encoding: the published ones that do not change while the copy is held
(model, snapshot, size, source, revision, slot), and two known only at prepare, `path` (where the model is in the
container, when it fits 64 characters) and `digest` (the sha256 of the snapshot's file list, of which the snapshot
id is the first 40 hex digits: a reader can check the tree it got is the one it asked for).

On the host the files live flat in `<kubelet dir>/plugins/models.weightcache.io/metadata/` as
`<claim uid>_<request>.json` (`_` is in neither a uid nor a request name; no directory per claim to create and
remove on every prepare); unprepare removes the claim's files.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.dra import DRIVER_NAME
from weightcache.dra.devices import MAX_STRING
from weightcache.errors import InvalidRequestError
from weightcache.store import Snapshot
from weightcache.store.fsops import Tree
from weightcache.store.records import tree_digest
from weightcache.uri import model_key

CONTAINER_DIR = "/var/run/kubernetes.io/dra-device-attributes"
CLAIMS_SUBDIR = "resourceclaims"
TEMPLATES_SUBDIR = "resourceclaimtemplates"
FILE_NAME = f"{DRIVER_NAME}-metadata.json"
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
API_VERSIONS = ("metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1")  # newest first
KIND = "DeviceMetadata"
MOUNT_OPTIONS = ("ro", "bind", "nosuid", "nodev", "noexec")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


@dataclass(frozen=True)
class MetadataDevice:
    """One allocated device as the metadata file describes it."""

    request: str  # as in the allocation result: `<request>` or `<request>/<subrequest>`
    pool: str
    device: str
    snapshot: Snapshot
    container_path: str
    slot: int | None = None


def top_request(request: str) -> str:
    """The path segment of a request: the top-level name (a prioritized list's subrequest is dropped)."""
    top = request.partition("/")[0]
    if not _DNS_LABEL.match(top):
        raise InvalidRequestError("status.allocation.devices.results.request", f"{request[:80]!r} is not a request "
                                  "name (a DNS label, optionally /<subrequest>)")
    return top


def pod_claim_name(claim: dict[str, Any]) -> str:
    """The pod's name for a claim made from a template ('' for a claim the pod names directly)."""
    value = ((claim.get("metadata") or {}).get("annotations") or {}).get(POD_CLAIM_ANNOTATION) or ""
    if value and not (isinstance(value, str) and _DNS_LABEL.match(value)):
        raise InvalidRequestError(f"metadata.annotations[{POD_CLAIM_ANNOTATION}]",
                                  f"{str(value)[:80]!r} is not a pod claim name (a DNS label)")
    return str(value)


def container_path(claim_name: str, pod_claim: str, request: str) -> str:
    """Where the file appears in the container (KEP-5304's layout)."""
    if pod_claim:
        return f"{CONTAINER_DIR}/{TEMPLATES_SUBDIR}/{pod_claim}/{top_request(request)}/{FILE_NAME}"
    return f"{CONTAINER_DIR}/{CLAIMS_SUBDIR}/{claim_name}/{top_request(request)}/{FILE_NAME}"


def host_path(metadata_dir: Path, claim_uid: str, request: str) -> Path:
    return metadata_dir / f"{claim_uid}_{top_request(request)}.json"


def device_attributes(d: MetadataDevice) -> dict[str, dict[str, Any]]:
    """The attributes a container reads: the stable published ones, `path` and `digest`."""
    snap = d.snapshot
    attrs: dict[str, dict[str, Any]] = {"model": {"string": model_key(snap.uri)}, "snapshot": {"string": snap.id},
                                        "size": {"int": snap.size}, "digest": {"string": tree_digest(snap.files)}}
    if len(snap.uri) <= MAX_STRING:
        attrs["source"] = {"string": snap.uri}
    if snap.revision and len(snap.revision) <= MAX_STRING:
        attrs["revision"] = {"string": snap.revision}
    if d.slot is not None:
        attrs["slot"] = {"int": d.slot}
    if len(d.container_path) <= MAX_STRING:
        attrs["path"] = {"string": d.container_path}
    return attrs


def build(claim_uid: str, namespace: str, claim_name: str, pod_claim: str,
          devices: Sequence[MetadataDevice]) -> list[dict[str, Any]]:
    """The DeviceMetadata objects of one request's file (one per API version, newest first); `devices` are those
    of one top-level request."""
    requests: dict[str, list[dict[str, Any]]] = {}
    for d in devices:
        requests.setdefault(d.request, []).append({"driver": DRIVER_NAME, "pool": d.pool, "name": d.device,
                                                   "attributes": device_attributes(d)})
    body: dict[str, Any] = {"metadata": {"name": claim_name, "namespace": namespace, "uid": claim_uid,
                                         "generation": 1}}
    if pod_claim:
        body["podClaimName"] = pod_claim
    body["requests"] = [{"name": name, "devices": devs} for name, devs in requests.items()]
    return [{"kind": KIND, "apiVersion": version, **body} for version in API_VERSIONS]


def encode(objects: Iterable[dict[str, Any]]) -> bytes:
    """A JSON stream: one object per line."""
    return b"".join(json.dumps(o, sort_keys=True, separators=(",", ":")).encode() + b"\n" for o in objects)


def write(metadata_dir: Path, claim_uid: str, namespace: str, claim_name: str, pod_claim: str,
          devices: Sequence[MetadataDevice]) -> dict[str, Path]:
    """Write one file per top-level request (0644: the container's user reads it, nobody writes it; not fsynced,
    like the CDI specs: a reboot ends the containers too). Returns request -> host path."""
    by_request: dict[str, list[MetadataDevice]] = {}
    for d in devices:
        by_request.setdefault(top_request(d.request), []).append(d)
    metadata_dir.mkdir(parents=True, exist_ok=True)
    tree = Tree(metadata_dir)
    written = {}
    for request, devs in by_request.items():
        path = host_path(metadata_dir, claim_uid, request)
        tree.write_atomic(path, encode(build(claim_uid, namespace, claim_name, pod_claim, devs)), mode=0o644,
                          durable=False)
        written[request] = path
    return written


def remove(metadata_dir: Path, claim_uid: str, requests: Iterable[str] | None = None) -> None:
    """Remove the claim's files: those of `requests`, or (a claim without a record) every file of the uid."""
    tree = Tree(metadata_dir)
    if requests is None:
        names = [n for n in tree.listdir(metadata_dir) if n.startswith(claim_uid + "_")] \
            if metadata_dir.is_dir() else []
        paths = [metadata_dir / n for n in names]
    else:
        paths = [host_path(metadata_dir, claim_uid, r) for r in requests]
    for path in paths:
        tree.unlink(path)
