"""The DRA gRPC service kubelet calls around a pod's life: NodePrepareResources / NodeUnprepareResources.

Kubelet sends only the claims' namespace, name and uid; the allocation (which devices of which pool) is read from
the ResourceClaim in the API server, as every DRA driver does. Preparing a claim, for each device allocated from
this node's pool by our driver:
  1. map the device name back to its snapshot (devices.snapshot_of) and check it is still in the store;
  2. policy: the claim's namespace must be allowed to read the model (the CSI publish's rule, weightcache.policy);
  3. lease `dra:<claim uid>/<device>` (eviction never removes it), write the device metadata file of each request
     (weightcache/dra/metadata.py), the claim's CDI spec, then its record.
Several claims may hold shares of one shared device (consumable capacity, `shareID` in their allocation results):
each has its own leases, CDI spec and metadata, so unpreparing one leaves the others as they were.
A repeat of a prepared claim answers from its record (rewriting a CDI spec a reboot wiped). Unprepare releases
the leases and removes the spec and the record; an unknown claim is fine (kubelet retries after our restart).
Every claim of a request gets an entry in the response; a failure is that entry's `error`, never the RPC's.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from weightcache.access import Authority, Requester
from weightcache.dra import DRIVER_NAME, cdi, metadata
from weightcache.dra._pb import dra_v1_pb2, dra_v1_pb2_grpc, dra_v1beta1_pb2, dra_v1beta1_pb2_grpc
from weightcache.dra.claims import ClaimBook, ClaimRecord, PreparedDevice, valid_uid
from weightcache.dra.devices import slot_of, snapshot_of
from weightcache.dra.fetchable import MODEL_READY, Fetchable, key_of
from weightcache.errors import InvalidRequestError, NewerRecordError, NotCachedError, WeightcacheError
from weightcache.redact import shorten
from weightcache.store import Snapshot, Store
from weightcache.store.holders import claim_of_holder
from weightcache.store.holders import dra_holder as holder_for
from weightcache.uri import parse_ref

log = logging.getLogger(__name__)

ClaimSource = Callable[[str, str], dict[str, Any]]  # (namespace, name) -> ResourceClaim; raises on failure
DEFAULT_CONTAINER_PATH = "/models/model"  # the webhook's single-model path
_ENV = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")
_CONFIG_KEYS = {"apiVersion", "kind", "mountPath", "env"}
_NAMESPACE = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # DNS-1123 label
_NAME = re.compile(r"^(?=.{1,253}$)[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")  # subdomain
_SHARE_ID = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")  # a DNS label (KEP-5075)


@dataclass(frozen=True)
class Allocated:
    request: str
    device: str
    container_path: str
    env_name: str
    share_id: str = ""


def allocated_devices(claim: dict[str, Any], *, pool: str) -> list[Allocated]:
    """Our devices in a ResourceClaim's allocation, with the opaque config (mountPath, env) that applies to each.

    Raises InvalidRequestError when the claim is not allocated, or allocated from another node's pool."""
    allocation = (claim.get("status") or {}).get("allocation") or {}
    devices = allocation.get("devices") or {}
    results = [r for r in devices.get("results") or [] if r.get("driver") == DRIVER_NAME]
    if not results:
        raise InvalidRequestError("status.allocation", f"the claim has no device of driver {DRIVER_NAME} "
                                  "allocated; the scheduler allocates it before kubelet prepares it")
    return [_allocated(result, devices.get("config") or [], pool) for result in results]


def _allocated(result: dict[str, Any], configs: list[dict[str, Any]], pool: str) -> Allocated:
    """One allocated device of ours, with the last of `configs` (the allocation's opaque ones) that applies."""
    if result.get("pool") != pool:
        raise InvalidRequestError("status.allocation.devices.results", f"device {result.get('device')!r} is "
                                  f"from pool {result.get('pool')!r}, not this node's pool {pool!r}")
    request = str(result.get("request", ""))
    share_id = result.get("shareID") or ""
    if share_id and not (isinstance(share_id, str) and _SHARE_ID.match(share_id)):
        raise InvalidRequestError("status.allocation.devices.results.shareID",
                                  f"{str(share_id)[:80]!r} is not a share id (a DNS label)")
    path, env = DEFAULT_CONTAINER_PATH, cdi.ENV_NAME
    for config in configs:  # later entries win, as in the API's documented order
        opaque = config.get("opaque") or {}
        wanted = config.get("requests") or []
        if opaque.get("driver") == DRIVER_NAME and (not wanted or request in wanted
                                                    or request.partition("/")[0] in wanted):
            path, env = _model_config(opaque.get("parameters") or {}, path, env)
    return Allocated(request, str(result.get("device", "")), path, env, share_id)


def _model_config(params: Any, path: str, env: str) -> tuple[str, str]:
    field = "status.allocation.devices.config.opaque.parameters"
    if not isinstance(params, dict):
        raise InvalidRequestError(field, "must be an object such as {mountPath: /models/llama}")
    unknown = set(params) - _CONFIG_KEYS
    if unknown:
        raise InvalidRequestError(field, f"unknown keys {sorted(unknown)}; known: mountPath, env")
    if "mountPath" in params:
        path = str(params["mountPath"])
        if not path.startswith("/") or "\0" in path or ".." in path.split("/") or len(path) > 4096 or path == "/":
            raise InvalidRequestError(f"{field}.mountPath", f"{path!r} must be an absolute path below / without '..'")
    if "env" in params:
        env = str(params["env"])
        if not _ENV.match(env):
            raise InvalidRequestError(f"{field}.env", f"{env!r} is not an environment variable name")
    return os.path.normpath(path), env


class ModelClaims:
    """Prepare and unprepare claims (blocking: call from a thread)."""

    def __init__(self, store: Store, book: ClaimBook, *, pool: str, cdi_dir: Path, claims: ClaimSource,
                 authority: Authority, fetchable: Callable[[str], Fetchable | None] | None = None,
                 metadata_dir: Path | None = None) -> None:
        self._fetchable = fetchable
        self._metadata_dir = metadata_dir
        self._store = store
        self._book = book
        self._pool = pool
        self._cdi_dir = cdi_dir
        self._claims = claims
        self._authority = authority

    def prepare(self, namespace: str, uid: str, name: str) -> ClaimRecord:
        for field, value in (("namespace", namespace), ("uid", uid), ("name", name)):
            if not value:
                raise InvalidRequestError(f"claims[].{field}", "is required")
        if not valid_uid(uid):
            raise InvalidRequestError("claims[].uid", f"{uid[:80]!r} is not a Kubernetes uid")
        # checked before they become a URL path of the API request (no '/', '..', NUL or 100 KB names)
        if not _NAMESPACE.match(namespace):
            raise InvalidRequestError("claims[].namespace", f"{namespace[:80]!r} is not a namespace name")
        if not _NAME.match(name):
            raise InvalidRequestError("claims[].name", f"{name[:80]!r} is not a ResourceClaim name")
        record = self._book.get(uid)
        if record is not None:
            return self._restore(record)
        claim = self._claims(namespace, name)
        actual = (claim.get("metadata") or {}).get("uid")
        if actual != uid:
            raise InvalidRequestError("claims[].uid", f"ResourceClaim {namespace}/{name} has uid {actual}, not "
                                      f"{uid}: it was deleted and created again; kubelet retries with the new one")
        prepared, snapshots = [], {}
        pod_claim = metadata.pod_claim_name(claim)
        for item in allocated_devices(claim, pool=self._pool):
            metadata.top_request(item.request)  # a request name that makes no path is refused before any lease
            snapshot_id = snapshot_of(item.device) or self._fetched(item.device, namespace)
            if snapshot_id is None:
                raise InvalidRequestError("status.allocation.devices.results.device",
                                          f"{item.device!r} is not a device this driver publishes")
            snapshot = snapshots[snapshot_id] = self._store.get(snapshot_id)  # NotCachedError: evicted since
            # the snapshot's own files: a grant limited by include/exclude covers exactly what it fetched
            self._authority.authorize(parse_ref(snapshot.uri, include=[f.path for f in snapshot.files]),
                                      Requester(namespace))  # NotAllowedError: weightcache/access.py
            prepared.append(PreparedDevice(item.request, self._pool, item.device, snapshot_id,
                                           str(snapshot.path), item.container_path, item.env_name, item.share_id))
        record = ClaimRecord(uid, namespace, name, tuple(prepared), time.time(), pod_claim)
        self._take(record, snapshots)
        log.info("prepared claim %s/%s (%s): %s", namespace, name, uid,
                 ", ".join(f"{d.device} at {d.container_path}" for d in prepared))
        return record

    def _fetched(self, device: str, namespace: str) -> str | None:
        """The snapshot a fetchable device (`f-<model key>`, docs/dra.md) was fetched as, for this namespace; None
        for a name this driver never publishes."""
        key = key_of(device)
        if key is None or self._fetchable is None:
            return None
        model = self._fetchable(key)
        if model is None:
            raise InvalidRequestError("status.allocation.devices.results.device",
                                      f"no ModelCache offers model {key} any more")
        grant = self._authority.authorize(model.ref, Requester(namespace))  # NotAllowedError
        snapshot = self._store.lookup(grant.ref)
        if snapshot is None:
            raise NotCachedError(f"model {model.ref.uri} is not in the store yet: the driver fetches it when the "
                                 f"device is allocated and sets {MODEL_READY} before the pod binds")
        return snapshot.id

    def _take(self, record: ClaimRecord, snapshots: dict[str, Snapshot]) -> None:
        """Leases, CDI spec, record, in that order; on failure undo what was done."""
        taken: list[str] = []
        try:
            for device in record.devices:
                holder = holder_for(record.uid, device.device)
                self._store.lease(holder, device.snapshot_id)
                taken.append(holder)
            cdi.write_spec(self._cdi_dir, record.uid, self._mounts(record, self._write_metadata(record, snapshots)))
            self._book.put(record)
        except BaseException:
            for holder in taken:
                self._store.release(holder)
            cdi.remove_spec(self._cdi_dir, record.uid)
            if self._metadata_dir is not None:
                metadata.remove(self._metadata_dir, record.uid, [d.request for d in record.devices])
            raise

    def _write_metadata(self, record: ClaimRecord, snapshots: dict[str, Snapshot] | None = None) -> dict[str, Path]:
        """The claim's device metadata files (request -> host path); none without a metadata directory."""
        if self._metadata_dir is None:
            return {}
        known = snapshots or {}
        devices = [metadata.MetadataDevice(d.request, d.pool, d.device,
                                           known.get(d.snapshot_id) or self._store.get(d.snapshot_id),
                                           d.container_path, slot_of(d.device)) for d in record.devices]
        return metadata.write(self._metadata_dir, record.uid, record.namespace, record.name, record.pod_claim,
                              devices)

    @staticmethod
    def _mounts(record: ClaimRecord, files: dict[str, Path]) -> list[cdi.ModelMount]:
        """One CDI device per allocated device (per share); the first of each request mounts its metadata file."""
        mounts, seen = [], set()
        for d in record.devices:
            request = metadata.top_request(d.request)
            file = files.get(request) if request not in seen else None
            seen.add(request)
            meta = (str(file), metadata.container_path(record.name, record.pod_claim, d.request)) if file else None
            mounts.append(cdi.ModelMount(d.device, d.host_path, d.container_path, d.env_name, d.share_id, meta))
        return mounts

    def _restore(self, record: ClaimRecord) -> ClaimRecord:
        """A prepared claim asked again: make sure its leases and spec are there (a reboot clears both)."""
        leases = self._store.leases()
        for device in record.devices:
            holder = holder_for(record.uid, device.device)
            if leases.get(holder) != device.snapshot_id:
                self._store.lease(holder, device.snapshot_id)
        files = {metadata.top_request(d.request): metadata.host_path(self._metadata_dir, record.uid, d.request)
                 for d in record.devices} if self._metadata_dir is not None else {}
        if not all(f.is_file() for f in files.values()):  # a reboot clears the plugin's run state
            files = self._write_metadata(record)
        if not cdi.spec_path(self._cdi_dir, record.uid).exists():
            cdi.write_spec(self._cdi_dir, record.uid, self._mounts(record, files))
        return record

    def unprepare(self, uid: str) -> None:
        if not valid_uid(uid):
            raise InvalidRequestError("claims[].uid", f"{uid[:80]!r} is not a Kubernetes uid")
        record = self._book.get(uid)
        holders = set(record.holders()) if record else set()
        holders |= {h for h in self._store.leases() if claim_of_holder(h) == uid}
        for holder in sorted(holders):
            self._store.release(holder)
        cdi.remove_spec(self._cdi_dir, uid)
        if self._metadata_dir is not None:
            metadata.remove(self._metadata_dir, uid, [d.request for d in record.devices] if record else None)
        self._book.remove(uid)
        if record is not None:
            log.info("unprepared claim %s/%s (%s)", record.namespace, record.name, uid)

    def reconcile(self) -> list[str]:
        """At startup: release `dra:` leases of claims without a record (a crash between lease and record)."""
        known = set(self._book.uids())
        released = [h for h in self._store.leases() if (uid := claim_of_holder(h)) is not None and uid not in known]
        for holder in released:
            self._store.release(holder)
        for uid in known:
            try:
                record = self._book.get(uid)
            except NewerRecordError as exc:  # a newer release's claim: its leases stay, its pod may still run
                log.warning("%s", exc)
                continue
            if record is not None:
                try:
                    self._restore(record)
                except NotCachedError as exc:  # its snapshot is gone: kubelet's next prepare reports it
                    log.warning("prepared claim %s/%s lost its model: %s", record.namespace, record.name, exc)
        log.info("DRA reconcile: %d prepared claims, %d stale leases released", len(known), len(released))
        return released


def _error_text(exc: BaseException, what: str) -> str:
    """The claim's error entry (kubelet shows it in the pod's events), bounded in size."""
    what = shorten(what, 300)
    if isinstance(exc, WeightcacheError):
        text = shorten(str(exc))
        log.info("%s: %s", what, text)
        return text
    log.exception("%s failed", what)
    return shorten(f"internal error: {exc}; see the weightcache daemon's log")


class DRAServicer(dra_v1_pb2_grpc.DRAPluginServicer):
    """k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin. One claim's operations never overlap (kubelet retries)."""

    def __init__(self, claims: ModelClaims) -> None:
        self._claims = claims
        self._locks: dict[str, asyncio.Lock] = {}

    def _lock(self, uid: str) -> asyncio.Lock:
        return self._locks.setdefault(uid, asyncio.Lock())

    async def NodePrepareResources(self, request: dra_v1_pb2.NodePrepareResourcesRequest,
                                   context: grpc.aio.ServicerContext[Any, Any]
                                   ) -> dra_v1_pb2.NodePrepareResourcesResponse:
        response = dra_v1_pb2.NodePrepareResourcesResponse()
        for claim in request.claims:
            if claim.uid in response.claims:  # the same claim twice: one answer, its devices once
                continue
            entry = response.claims[claim.uid]
            async with self._lock(claim.uid):
                try:
                    record = await asyncio.to_thread(self._claims.prepare, claim.namespace, claim.uid, claim.name)
                except Exception as exc:
                    entry.error = _error_text(exc, f"preparing claim {claim.namespace}/{claim.name}")
                    continue
            for device in record.devices:
                entry.devices.add(request_names=[device.request] if device.request else [], pool_name=device.pool,
                                  device_name=device.device,
                                  cdi_device_ids=[cdi.cdi_id(record.uid, device.device, device.share_id)])
        return response

    async def NodeUnprepareResources(self, request: dra_v1_pb2.NodeUnprepareResourcesRequest,
                                     context: grpc.aio.ServicerContext[Any, Any]
                                     ) -> dra_v1_pb2.NodeUnprepareResourcesResponse:
        response = dra_v1_pb2.NodeUnprepareResourcesResponse()
        for claim in request.claims:
            entry = response.claims[claim.uid]
            async with self._lock(claim.uid):
                try:
                    await asyncio.to_thread(self._claims.unprepare, claim.uid)
                except Exception as exc:
                    entry.error = _error_text(exc, f"unpreparing claim {claim.namespace}/{claim.name}")
            self._locks.pop(claim.uid, None)
        return response


class DRAServicerV1beta1(dra_v1beta1_pb2_grpc.DRAPluginServicer):
    """k8s.io.kubelet.pkg.apis.dra.v1beta1.DRAPlugin (kubelet 1.32-1.33): the same messages field for field, so
    requests and responses cross over by their wire bytes."""

    def __init__(self, v1: DRAServicer) -> None:
        self._v1 = v1

    async def NodePrepareResources(self, request: dra_v1beta1_pb2.NodePrepareResourcesRequest,
                                   context: grpc.aio.ServicerContext[Any, Any]
                                   ) -> dra_v1beta1_pb2.NodePrepareResourcesResponse:
        answer = await self._v1.NodePrepareResources(
            dra_v1_pb2.NodePrepareResourcesRequest.FromString(request.SerializeToString()), context)
        return dra_v1beta1_pb2.NodePrepareResourcesResponse.FromString(answer.SerializeToString())

    async def NodeUnprepareResources(self, request: dra_v1beta1_pb2.NodeUnprepareResourcesRequest,
                                     context: grpc.aio.ServicerContext[Any, Any]
                                     ) -> dra_v1beta1_pb2.NodeUnprepareResourcesResponse:
        answer = await self._v1.NodeUnprepareResources(
            dra_v1_pb2.NodeUnprepareResourcesRequest.FromString(request.SerializeToString()), context)
        return dra_v1beta1_pb2.NodeUnprepareResourcesResponse.FromString(answer.SerializeToString())
