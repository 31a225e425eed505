"""Binding conditions (Kubernetes 1.36+): fetch a model when the scheduler allocates its fetchable device here.

The scheduler allocates an `f-<model key>` device (weightcache/dra/fetchable.py) and copies the device's binding
conditions into the claim's `status.allocation.devices.results[]`; it then waits in PreBind. `ClaimBinder` watches
ResourceClaims (list+watch through the official client, weightcache.kube.watch), and for each result naming a
fetchable device of this node's pool with the binding condition `weightcache.io/model-ready`:

  1. authorizes the claim's namespace for the model (`Authority.authorize(ref, Requester(namespace))`);
  2. fetches it through the node's fetch queue (single flight with every other door), and leases the snapshot
     `dra:<claim uid>/<device>` so eviction leaves it until NodePrepare takes the same lease;
  3. sets the condition on the claim's `status.devices[]` entry {driver, pool, device}: `model-ready` True
     (reason `Fetched`), or `model-failed` True with reason `NotAllowed` (the policy's words), `NotDeclared` or
     `FetchFailed`; the scheduler then binds the pod, or un-allocates the claim and tries again.

The status is written with a JSON merge patch carrying the claim's resourceVersion (a conflict re-reads and
retries), keeping every other driver's entries and conditions. A write the API server refuses, or one that does
not reach it, is tried again on the binder's own clock (1 s, doubling to 30 s), not on the next ResourceClaim
event, until it lands or the allocation it answers is gone; each failure is logged with the server's whole reason
(on 1.36 a missing `resourceclaims/driver` grant is named at the end of a long 422). A lease taken for a claim
that is deleted before it was prepared is released at the next event.

An answer belongs to one allocation, not to the claim: after `model-failed` the scheduler un-allocates the claim
(the API server then drops its `status.devices` entries) and may allocate the same device to it again, which is a
new question. So what was answered is keyed by (claim uid, device, allocation), the allocation named by its
`allocationTimestamp` and results, and forgotten once the claim no longer holds that allocation.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import hashlib
import json
import logging
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from weightcache.access import Authority, Grant, Requester
from weightcache.dra import DRIVER_NAME
from weightcache.dra.claims import ClaimBook
from weightcache.dra.fetchable import MODEL_FAILED, MODEL_READY, Fetchable, key_of
from weightcache.dra.slices import API_TIMEOUT_S
from weightcache.errors import NotAllowedError
from weightcache.redact import shorten
from weightcache.store import Snapshot, Store
from weightcache.store.holders import claim_of_holder, dra_holder

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

log = logging.getLogger(__name__)

GROUP = "resource.k8s.io"
PLURAL = "resourceclaims"
Resolve = Callable[[str], Fetchable | None]  # model key -> the model a ModelCache offers, or None
Fetch = Callable[[Grant], Awaitable[Snapshot]]
Answer = tuple[str, str, str]  # (claim uid, device, allocation id)
RETRY_FIRST_S, RETRY_MAX_S = 1.0, 30.0  # a refused status write is tried again after 1 s, doubling to 30 s


class AllocationGone(Exception):
    """The allocation a verdict answers is no longer the claim's: nothing to write."""


def condition(kind: str, reason: str, message: str) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"type": kind, "status": "True", "reason": reason, "message": shorten(message, 1000),
            "lastTransitionTime": now}


def allocation_id(claim: dict[str, Any]) -> str:
    """Names the claim's current allocation: the scheduler stamps each allocation (`allocationTimestamp`, whole
    seconds), and the results distinguish two allocations within one second; '' when not allocated."""
    allocation = (claim.get("status") or {}).get("allocation")
    if not allocation:
        return ""
    results = ((allocation.get("devices") or {}).get("results")) or []
    digest = hashlib.sha256(json.dumps(results, sort_keys=True).encode()).hexdigest()[:16]
    return f"{allocation.get('allocationTimestamp', '')}/{digest}"


def allocated(claim: dict[str, Any], pool: str) -> set[str]:
    """This driver's devices of `pool` in the claim's allocation."""
    results = ((((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results")) or []
    return {str(r.get("device")) for r in results if r.get("driver") == DRIVER_NAME and r.get("pool") == pool}


def pending(claim: dict[str, Any], pool: str) -> list[str]:
    """The fetchable devices of `pool` allocated in `claim` that wait for model-ready and have no verdict yet."""
    status = claim.get("status") or {}
    results = (((status.get("allocation") or {}).get("devices") or {}).get("results")) or []
    decided = {str(d.get("device")) for d in status.get("devices") or []
               if d.get("driver") == DRIVER_NAME and d.get("pool") == pool
               and any(c.get("type") in (MODEL_READY, MODEL_FAILED) and c.get("status") == "True"
                       for c in d.get("conditions") or [])}
    return [str(r["device"]) for r in results
            if r.get("driver") == DRIVER_NAME and r.get("pool") == pool and key_of(str(r.get("device", "")))
            and MODEL_READY in (r.get("bindingConditions") or []) and str(r["device"]) not in decided]


class ClaimBinder:
    """Watches ResourceClaims and answers the binding conditions of this node's fetchable devices."""

    def __init__(self, api_client: ApiClient, *, pool: str, store: Store, authority: Authority, resolve: Resolve,
                 fetch: Fetch, api_version: str = "v1") -> None:
        from weightcache.kube.client import CustomObjectsApi

        self._client = api_client
        self._api = CustomObjectsApi(api_client)
        self._pool = pool
        self._store = store
        self._book = ClaimBook(store.layout.tree)
        self._authority = authority
        self._resolve = resolve
        self._fetch = fetch
        self._version = api_version
        self._tasks: dict[Answer, asyncio.Task[None]] = {}
        self._done: set[Answer] = set()
        self.timings: dict[tuple[str, str], float] = {}  # (claim uid, device) -> seconds to the verdict
        self.retry_first_s = RETRY_FIRST_S

    async def run(self) -> None:
        from weightcache.kube.watch import ModelCacheWatcher

        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        lister = functools.partial(self._api.list_cluster_custom_object, GROUP, self._version, PLURAL)

        def changed(_items: list[dict[str, Any]]) -> None:
            loop.call_soon_threadsafe(wake.set)

        watcher = ModelCacheWatcher(self._client, lister=lister, on_change=changed)
        watcher.start()
        try:
            while True:
                await wake.wait()
                wake.clear()
                try:
                    await self._scan(watcher.items())
                except Exception:  # a bug must not end the binder: the next event scans again
                    log.exception("answering DRA binding conditions failed")
        finally:
            for task in self._tasks.values():
                task.cancel()
            for task in list(self._tasks.values()):
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await asyncio.to_thread(watcher.stop)

    async def _scan(self, claims: list[dict[str, Any]]) -> None:
        live: set[str] = set()
        held: set[Answer] = set()  # every (claim, device, allocation) the claims hold now, answered or not
        for claim in claims:
            uid = str((claim.get("metadata") or {}).get("uid", ""))
            live.add(uid)
            alloc = allocation_id(claim)
            held |= {(uid, device, alloc) for device in allocated(claim, self._pool)}
            for device in pending(claim, self._pool):
                key = (uid, device, alloc)
                if key not in self._tasks and key not in self._done:
                    self._tasks[key] = asyncio.create_task(self._bind(claim, device, alloc),
                                                           name=f"dra-bind-{device}")
        self._done &= held  # an answer is forgotten with its allocation: a re-allocation is asked anew
        await asyncio.to_thread(self._release_gone, live)

    def _release_gone(self, live: set[str]) -> None:
        for holder in self._store.leases():
            uid = claim_of_holder(holder)
            if uid is not None and uid not in live and holder.partition("/")[2].startswith("f-") \
                    and self._book.get(uid) is None:
                self._store.release(holder)
                log.info("released %s: its claim is gone and was never prepared", holder)

    async def _bind(self, claim: dict[str, Any], device: str, alloc: str) -> None:
        from weightcache.kube.client import api_reason

        meta = claim.get("metadata") or {}
        namespace, name, uid = str(meta.get("namespace")), str(meta.get("name")), str(meta.get("uid"))
        started = time.monotonic()
        delay = self.retry_first_s
        try:
            verdict = await self._verdict(namespace, uid, device)
            while True:
                try:
                    await asyncio.to_thread(self._set, namespace, name, uid, device, alloc, verdict)
                    break
                except AllocationGone as exc:
                    log.info("claim %s/%s device %s: not answered, %s", namespace, name, device, exc)
                    return
                except Exception as exc:  # refused or unreachable: again on our own clock, not on the next event
                    log.warning("setting the binding condition %s of claim %s/%s device %s failed: %s; trying again "
                                "in %.0f s", verdict["type"], namespace, name, device,
                                shorten(api_reason(exc), 4000), delay)
                    await asyncio.sleep(delay)
                    delay = min(delay * 2, RETRY_MAX_S)
            self._done.add((uid, device, alloc))
            self.timings[(uid, device)] = time.monotonic() - started
            log.info("claim %s/%s device %s: %s %s (%.1f s after allocation was seen)", namespace, name, device,
                     verdict["type"], verdict["reason"], time.monotonic() - started)
        finally:
            self._tasks.pop((uid, device, alloc), None)

    async def _verdict(self, namespace: str, uid: str, device: str) -> dict[str, Any]:
        key = key_of(device) or ""
        model = self._resolve(key)
        if model is None:
            return condition(MODEL_FAILED, "NotDeclared", f"no ModelCache offers model {key} any more; the "
                             "scheduler tries another device")
        try:
            grant = self._authority.authorize(model.ref, Requester(namespace))
        except NotAllowedError as exc:
            return condition(MODEL_FAILED, "NotAllowed", str(exc))
        started = time.monotonic()
        try:
            snapshot = await self._fetch(grant)
            await asyncio.to_thread(self._store.lease, dra_holder(uid, device), snapshot.id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return condition(MODEL_FAILED, "FetchFailed", f"fetching {model.ref.uri} failed: {exc}")
        return condition(MODEL_READY, "Fetched", f"{model.ref.uri} is in the node's store as snapshot "
                         f"{snapshot.id} ({snapshot.size} bytes, {time.monotonic() - started:.1f} s)")

    def _with_verdict(self, claim: dict[str, Any], device: str, verdict: dict[str, Any]) -> list[dict[str, Any]]:
        """The claim's status.devices with `verdict` as our device's model condition (its entry made if missing)."""
        entries = list((claim.get("status") or {}).get("devices") or [])
        ours = {"driver": DRIVER_NAME, "pool": self._pool, "device": device}
        index = next((i for i, e in enumerate(entries)
                      if all(e.get(k) == v for k, v in ours.items()) and not e.get("shareID")), None)
        entry: dict[str, Any] = dict(entries[index]) if index is not None else dict(ours)
        entry["conditions"] = [c for c in entry.get("conditions") or []
                               if c.get("type") not in (MODEL_READY, MODEL_FAILED)] + [verdict]
        if index is None:
            entries.append(entry)
        else:
            entries[index] = entry
        return entries

    def _set(self, namespace: str, name: str, uid: str, device: str, alloc: str, verdict: dict[str, Any]) -> None:
        """Merge the condition into the claim's status.devices entry; a conflict re-reads and retries. Raises
        AllocationGone when the claim no longer holds the allocation the verdict answers."""
        from weightcache.kube.client import ApiException

        for attempt in range(5):
            try:
                claim = self._api.get_namespaced_custom_object(GROUP, self._version, namespace, PLURAL, name,
                                                               _request_timeout=API_TIMEOUT_S)
            except ApiException as exc:
                if exc.status == 404:
                    raise AllocationGone("the claim was deleted") from None
                raise
            if str(claim["metadata"].get("uid")) != uid or allocation_id(claim) != alloc \
                    or device not in allocated(claim, self._pool):
                raise AllocationGone("the claim was allocated anew or un-allocated since")
            body = {"metadata": {"resourceVersion": claim["metadata"]["resourceVersion"]},
                    "status": {"devices": self._with_verdict(claim, device, verdict)}}
            try:
                self._api.patch_namespaced_custom_object_status(GROUP, self._version, namespace, PLURAL, name, body,
                                                                _request_timeout=API_TIMEOUT_S)
                return
            except ApiException as exc:
                if exc.status != 409 or attempt == 4:
                    raise
