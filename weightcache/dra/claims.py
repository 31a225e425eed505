"""Prepared-claim records: what NodePrepareResources did, so retries and a restarted daemon answer the same.

    <store root>/dra/claims/<claim uid>.json
    {"uid": "...", "namespace": "ml", "name": "vllm-0-model-x7k2p", "prepared_at": 1767312000.0,
     "devices": [{"request": "model", "pool": "node-1", "device": "m-<snapshot>-0", "snapshot_id": "...",
                  "host_path": "...", "container_path": "/models/model", "env_name": "WEIGHTCACHE_MODEL_PATH",
                  "share_id": ""}], "pod_claim": "model"}

Each device holds the store lease `dra:<claim uid>/<device>` (eviction never removes a prepared model). A record
is written (durably: kubelet's own checkpoint outlives a reboot, and so must ours) after the leases and the CDI
spec, and removed after both are gone on unprepare.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from weightcache.store import RecordBook, Tree
from weightcache.store.holders import DRA_RECORD_VERSION, DRA_RECORDS
from weightcache.store.holders import dra_holder as holder_for

_UID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9-]{0,127}$")  # metadata.uid: a UUID in practice; never a path


@dataclass(frozen=True)
class PreparedDevice:
    request: str
    pool: str
    device: str
    snapshot_id: str
    host_path: str
    container_path: str
    env_name: str
    share_id: str = ""  # the allocation result's shareID (a shared device: consumable capacity)


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    prepared_at: float = 0.0
    pod_claim: str = ""  # pod.spec.resourceClaims[].name of a claim made from a template (its metadata path)

    def holders(self) -> list[str]:
        return [holder_for(self.uid, d.device) for d in self.devices]


def valid_uid(uid: str) -> bool:
    return bool(_UID.match(uid))


class ClaimBook:
    """The claim records of one store: a RecordBook (weightcache/store/book.py) under `dra/claims`, durable."""

    def __init__(self, tree: Tree) -> None:
        self._book = RecordBook(tree, *DRA_RECORDS, fields=_FIELDS, version=DRA_RECORD_VERSION)
        self.dir = self._book.dir

    def get(self, uid: str) -> ClaimRecord | None:
        """The claim's record; None when there is none or it was damaged (quarantined: kubelet retries)."""
        return self._book.get(_name(uid), lambda obj: _parse(obj, uid))

    def put(self, record: ClaimRecord) -> None:
        self._book.put(_name(record.uid), dataclasses.asdict(record))

    def remove(self, uid: str) -> None:
        self._book.remove(_name(uid))

    def uids(self) -> list[str]:
        return [n for n in self._book.names() if valid_uid(n)]


_FIELDS = frozenset(f.name for f in dataclasses.fields(ClaimRecord))
_DEVICE_FIELDS = frozenset(f.name for f in dataclasses.fields(PreparedDevice))


def _name(uid: str) -> str:
    if not valid_uid(uid):
        raise ValueError(f"claim uid {uid!r} is not a Kubernetes uid")
    return uid


def _parse(obj: Any, uid: str) -> ClaimRecord:
    record = ClaimRecord(str(obj["uid"]), str(obj["namespace"]), str(obj["name"]),
                         tuple(PreparedDevice(**{k: str(v) for k, v in d.items() if k in _DEVICE_FIELDS})
                               for d in obj["devices"]),  # a newer minor's device fields: not ours to read
                         float(obj["prepared_at"]), str(obj.get("pod_claim") or ""))
    if record.uid != uid:
        raise ValueError(f"the record names claim {record.uid!r}, not {uid!r}")
    return record
