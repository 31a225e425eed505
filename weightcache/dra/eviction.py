"""NoExecute on a damaged copy for the pods the upstream eviction controller does not see.

A damaged snapshot's devices carry the taint `weightcache.io/unavailable=damaged:NoExecute` (weightcache/dra/
devices.py). kube-controller-manager's device taint eviction controller evicts the pods whose claims use such a
device, but it finds a pod's claims in `pod.spec.resourceClaims` only. A pod that got the model as a DRA extended
resource (`weightcache.io/via: dra-extended`) has no claim there: the scheduler made the claim and recorded it
in `pod.status.extendedResourceClaimStatus.resourceClaimName`. Left alone, such a pod would keep running on (and
a restarted container reload) a damaged copy.

The node daemon knows which claims hold a device of a damaged snapshot (its prepared-claim records), so it deals
with exactly those pods: `ExtendedPodEvictor.sweep()` reads each such claim's `status.reservedFor` pods and deletes
the ones whose extended-resource claim it is, as the upstream controller deletes its pods, unless the allocation
tolerates the taint (a `tolerationSeconds` toleration delays it until `timeAdded` + that many seconds). Pods that
name the claim in their spec are the controller's and are left to it. The daemon's RBAC gets `get` and `delete`
on pods, and deploy/dra/rbac.yaml's admission policy limits the delete to pods bound to the daemon's own node.
"""

from __future__ import annotations

import calendar
import logging
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

from weightcache.dra import DRIVER_NAME
from weightcache.dra.claims import ClaimBook, ClaimRecord
from weightcache.dra.devices import TAINT_KEY
from weightcache.dra.slices import API_TIMEOUT_S
from weightcache.dra.states import DAMAGED, DeviceState

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

log = logging.getLogger(__name__)


def tolerated_until(result: dict[str, Any], taint_since: str) -> float | None:
    """When the allocation result's tolerations stop tolerating the damaged taint: None when none tolerates it
    (evict now), +inf when one does for ever, else timeAdded + tolerationSeconds (core/v1 toleration rules)."""
    best: float | None = None
    for t in result.get("tolerations") or []:
        key_ok = t.get("key") == TAINT_KEY or (not t.get("key") and t.get("operator") == "Exists")
        value_ok = t.get("operator") == "Exists" or t.get("value", "") == DAMAGED
        if not (key_ok and value_ok and t.get("effect") in (None, "", "NoExecute")):
            continue
        seconds = t.get("tolerationSeconds")
        until = float("inf") if seconds is None else calendar.timegm(
            time.strptime(taint_since, "%Y-%m-%dT%H:%M:%SZ")) + max(0, int(seconds))
        best = until if best is None else max(best, until)
    return best


class ExtendedPodEvictor:
    """Deletes the `dra-extended` pods of this node whose claims hold a device of a damaged snapshot."""

    def __init__(self, api_client: ApiClient, *, book: ClaimBook, states: Callable[[], Mapping[str, DeviceState]],
                 api_version: str = "v1") -> None:
        from weightcache.kube.client import CoreV1Api, CustomObjectsApi

        self._objects = CustomObjectsApi(api_client)
        self._core = CoreV1Api(api_client)
        self._book = book
        self._states = states
        self._version = api_version

    def sweep(self) -> list[str]:
        """One pass (blocking: run it in a thread); returns `namespace/name` of each pod deleted."""
        damaged = {sid: s for sid, s in self._states().items() if s.state == DAMAGED}
        if not damaged:
            return []
        deleted: list[str] = []
        for uid in self._book.uids():
            record = self._book.get(uid)
            if record is not None and any(d.snapshot_id in damaged for d in record.devices):
                deleted += self._evict_for(record, damaged)
        return deleted

    def _evict_for(self, record: ClaimRecord, damaged: Mapping[str, DeviceState]) -> list[str]:
        from weightcache.kube.client import ApiException

        try:
            claim = self._objects.get_namespaced_custom_object("resource.k8s.io", self._version, record.namespace,
                                                               "resourceclaims", record.name,
                                                               _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status != 404:
                log.warning("reading claim %s/%s of a damaged copy failed: HTTP %s", record.namespace, record.name,
                            exc.status)
            return []
        if (claim.get("metadata") or {}).get("uid") != record.uid or not self._due(claim, record, damaged):
            return []
        deleted = []
        for ref in (claim.get("status") or {}).get("reservedFor") or []:
            if ref.get("resource") == "pods" and self._delete_if_extended(record, str(ref.get("name")),
                                                                           str(ref.get("uid"))):
                deleted.append(f"{record.namespace}/{ref.get('name')}")
        return deleted

    def _due(self, claim: dict[str, Any], record: ClaimRecord, damaged: Mapping[str, DeviceState]) -> bool:
        """True when some damaged device of the claim is not (or no longer) tolerated by its allocation."""
        results = (((claim.get("status") or {}).get("allocation") or {}).get("devices") or {}).get("results") or []
        now = time.time()
        for d in record.devices:
            if d.snapshot_id not in damaged:
                continue
            for r in results:
                if r.get("driver") == DRIVER_NAME and r.get("pool") == d.pool and r.get("device") == d.device:
                    until = tolerated_until(r, damaged[d.snapshot_id].since)
                    if until is None or until <= now:
                        return True
        return False

    def _delete_if_extended(self, record: ClaimRecord, name: str, uid: str) -> bool:
        from weightcache.kube.client import ApiException, V1DeleteOptions, V1Preconditions

        try:
            pod = self._core.read_namespaced_pod(name, record.namespace, _request_timeout=API_TIMEOUT_S)
            status = pod.status.extended_resource_claim_status if pod.status is not None else None
            if pod.metadata.uid != uid or pod.metadata.deletion_timestamp is not None or status is None \
                    or status.resource_claim_name != record.name:
                return False  # gone, going, or a spec claim: kube-controller-manager's device taint controller's
            self._core.delete_namespaced_pod(name, record.namespace, body=V1DeleteOptions(
                preconditions=V1Preconditions(uid=uid)), _request_timeout=API_TIMEOUT_S)
        except ApiException as exc:
            if exc.status not in (404, 409):
                log.warning("evicting pod %s/%s from a damaged model copy failed: HTTP %s %s", record.namespace,
                            name, exc.status, exc.reason)
            return False
        log.warning("evicted pod %s/%s: its model (claim %s, via dra-extended) is a damaged copy on this node",
                    record.namespace, name, record.name)
        return True
