"""Store snapshots as ResourceSlice devices (pure: no I/O).

One cached snapshot is `slots` devices named `m-<snapshot id>-<slot>`, so that up to `slots` claims on the node
can hold the same model at once (the stable DRA API allocates a device to one claim). Where the cluster has
consumable capacity (DRAConsumableCapacity: alpha in 1.34, beta in 1.36), `shared=True` publishes one device per
snapshot, `m-<snapshot id>`, with `allowMultipleAllocations: true` and the consumable capacity `readers` (value
`slots`, requestPolicy default 1, valid values [1]): every claim allocated the device consumes one reader, with or
without `capacity.requests`, so up to `slots` claims share it, and the scheduler records each share's `shareID` and
`consumedCapacity` in the claim's allocation result. (A capacity without a requestPolicy on such a device would be
consumed whole by a claim that does not ask for it: one claim would lock the model.) The device name carries the
snapshot id, so a restarted plugin maps an allocated device back to its snapshot without any saved table.

Attributes (unqualified names: the API qualifies them with the driver's domain, so a CEL selector reads
`device.attributes["models.weightcache.io"].model`). String values longer than the API's 64 characters are left
out rather than cut, because a cut value would match the wrong claim:

    model     string  m + 20 hex: the model key of the canonical source (weightcache.uri.model_key); always set
    source    string  canonical source URI, when it fits 64 characters
    revision  string  the source revision the snapshot was fetched at, when known and short enough
    latest    bool    true: the snapshot the store's `latest` ref of its model names (what a pod naming no revision
                      mounts; a rollout's switch moves it, docs/modelcache.md), or every snapshot of a model without
                      one; a claim that names no revision selects it (dra/template.selector)
    snapshot  string  snapshot id (40 hex)
    size      int     bytes
    tier      string  "memory" when resident in the memory tier, else "disk"
    ready     bool    true: only complete, published snapshots become devices
    slot      int     0..slots-1 (slot mode only)
    signed    bool    true: its model.sig verified under a signature requirement (docs/signing.md); false: never
                      asked, or published unsigned under allowUnsigned
    signer    string  who signed it, when signed: the key's sha256 (64 hex) or the certificate's identity (if it fits)

A snapshot being evicted, re-verified or found damaged (`weightcache.dra.states`) keeps its devices, tainted
`weightcache.io/unavailable=<state>`: effect NoSchedule (no new allocation), NoExecute for `damaged` only (pods
whose claims do not tolerate it are evicted; a toleration's `tolerationSeconds` is the window they keep).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Collection, Iterable, Mapping
from typing import Any

from weightcache.dra.states import DAMAGED, DeviceState
from weightcache.engine_cache import is_engine_cache
from weightcache.store import Snapshot, SnapshotInfo
from weightcache.units import quantity
from weightcache.uri import model_key
from weightcache.vocabulary import GROUP

log = logging.getLogger(__name__)

MAX_STRING = 64  # DeviceAttribute.string
MAX_ATTRIBUTES = 32  # attributes + capacities per device
MAX_SLOTS = 64
MAX_INT = (1 << 63) - 1  # DeviceAttribute.int is an int64: a larger value fails the whole slice's write
_NAME = re.compile(r"^m-(?P<id>[0-9a-f]{40})(?:-(?P<slot>[0-9]{1,2}))?$")
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_C_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")
TAINT_KEY = f"{GROUP}/unavailable"
READERS = "readers"  # the shared device's consumable capacity: claims holding the model at once


def readers_capacity(readers: int) -> dict[str, dict[str, Any]]:
    """The shared device's `capacity`: `readers` claims at once, each consuming exactly one (a request for more is
    refused by the policy, one for less is rounded up to one)."""
    return {READERS: {"value": quantity(readers), "requestPolicy": {"default": "1", "validValues": ["1"]}}}


def taint(state: DeviceState) -> dict[str, Any]:
    """The DeviceTaint of a held copy that must not be allocated now: NoExecute only when damaged."""
    return {"key": TAINT_KEY, "value": state.state, "effect": "NoExecute" if state.state == DAMAGED else "NoSchedule",
            "timeAdded": state.since}


def device_name(snapshot_id: str, slot: int | None) -> str:
    """`m-<snapshot id>-<slot>` (slot mode) or `m-<snapshot id>` (shared mode): a DNS label."""
    name = f"m-{snapshot_id}" if slot is None else f"m-{snapshot_id}-{slot}"
    if not _NAME.match(name) or not _DNS_LABEL.match(name):
        raise ValueError(f"snapshot id {snapshot_id!r} does not make a device name (expected 40 hex digits)")
    return name


def snapshot_of(name: str) -> str | None:
    """The snapshot id a device name of ours carries, or None for a name we never publish."""
    match = _NAME.match(name)
    return match["id"] if match else None


def slot_of(name: str) -> int | None:
    """The slot a slot device's name carries; None for a shared device or a name we never publish."""
    match = _NAME.match(name)
    return int(match["slot"]) if match and match["slot"] is not None else None


def attributes(snapshot: Snapshot, *, resident: bool, slot: int | None,
               signature: Mapping[str, object] | None = None, latest: bool = True) -> dict[str, dict[str, Any]]:
    signer = str((signature or {}).get("signer") or "")
    signed = bool(signature) and (signature or {}).get("method") in ("key", "certificate") and bool(signer)
    attrs: dict[str, dict[str, Any]] = {
        "model": {"string": model_key(snapshot.uri)},
        "snapshot": {"string": snapshot.id},
        "size": {"int": snapshot.size},
        "tier": {"string": "memory" if resident else "disk"},
        "ready": {"bool": True},
        "signed": {"bool": signed},
        "latest": {"bool": latest},
    }
    if signed and len(signer) <= MAX_STRING:
        attrs["signer"] = {"string": signer}
    if len(snapshot.uri) <= MAX_STRING:
        attrs["source"] = {"string": snapshot.uri}
    if snapshot.revision and len(snapshot.revision) <= MAX_STRING:
        attrs["revision"] = {"string": snapshot.revision}
    if slot is not None:
        attrs["slot"] = {"int": slot}
    if not isinstance(snapshot.size, int) or not 0 <= snapshot.size <= MAX_INT:
        raise ValueError(f"size {snapshot.size!r} is not an int64 byte count")
    if len(attrs) > MAX_ATTRIBUTES or not all(_C_IDENTIFIER.match(k) for k in attrs):
        raise ValueError(f"attributes {sorted(attrs)} break the API's rules for device attributes")
    return attrs


def latest_ids(infos: Iterable[SnapshotInfo]) -> set[str]:
    """The snapshots the store's `latest` refs name (a ref without a revision is listed as the bare uri)."""
    return {i.snapshot.id for i in infos if i.snapshot.uri in i.refs}


def devices_for(snapshots: Iterable[Snapshot], *, slots: int, shared: bool, resident: Collection[str] = (),
                states: Mapping[str, DeviceState] | None = None,
                signatures: Mapping[str, Mapping[str, object]] | None = None,
                latest: Collection[str] | None = None,
                reported: set[tuple[str, str]] | None = None) -> list[dict[str, Any]]:
    """The devices of a node holding `snapshots`, sorted by name (stable output: equal input, equal slices).
    `latest`: the snapshot ids the store's `latest` refs name (None: not known, every device is `latest`).
    `reported`: the (snapshot, reason)s already warned about, kept by the caller across calls (the daemon's
    resyncs): each is logged once (at most 1024).

    A snapshot that makes no valid device (a damaged index row, a size past int64) is logged and left out: the API
    server would refuse the whole slice for it, and with it every other model of the node."""
    if not 1 <= slots <= MAX_SLOTS:
        raise ValueError(f"slots must be 1..{MAX_SLOTS}, got {slots}")
    snapshots = list(snapshots)
    reported = set() if reported is None else reported
    named = {s.uri for s in snapshots if latest is not None and s.id in latest}  # models whose latest is known
    devices = []
    for snapshot in snapshots:
        try:
            if is_engine_cache(snapshot):  # an engine's compile cache is not a model: it grants nothing as a device
                continue
            state = (states or {}).get(snapshot.id)
            devices.extend(_devices_of(snapshot, slots=slots, shared=shared, resident=snapshot.id in resident,
                                       taints=[taint(state)] if state is not None else [],
                                       signature=(signatures or {}).get(snapshot.id),
                                       latest=latest is None or snapshot.id in latest or snapshot.uri not in named))
        except (ValueError, TypeError, AttributeError) as exc:  # AttributeError: a damaged row's None uri
            if len(reported) < 1024 and (snapshot.id, str(exc)) not in reported:  # once, not every resync
                reported.add((snapshot.id, str(exc)))
                log.warning("snapshot %r (%r) is not published as a DRA device: %s; run `weightcache verify "
                            "--repair`, or evict it", snapshot.id, snapshot.uri, exc)
    return sorted(devices, key=lambda d: str(d["name"]))


def _devices_of(snapshot: Snapshot, *, slots: int, shared: bool, resident: bool,
                taints: list[dict[str, Any]], signature: Mapping[str, object] | None = None,
                latest: bool = True) -> list[dict[str, Any]]:
    devices = []
    for slot in (None,) if shared else range(slots):
        device: dict[str, Any] = {
            "name": device_name(snapshot.id, slot),
            "attributes": attributes(snapshot, resident=resident, slot=slot, signature=signature, latest=latest),
        }
        if shared:
            device["allowMultipleAllocations"] = True
            device["capacity"] = readers_capacity(slots)
        if taints:
            device["taints"] = [dict(t) for t in taints]
        devices.append(device)
    return devices
