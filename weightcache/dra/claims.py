"""Prepared-claim records: what NodePrepareResources did, so retries and a restarted daemon answer the same.

    <store root>/dra/claims/<claim uid>.json
    {"uid": "...", "namespace": "ml", "name": "vllm-0-model-x7k2p", "prepared_at": 1767312000.0,
     "devices": [{"request": "model", "pool": "node-1", "device": "m-<snapshot>-0", "snapshot_id": "...",
                  "host_path": "...", "container_path": "/models/model", "env_name": "WEIGHTCACHE_MODEL_PATH"}]}

Each device holds the store lease `dra:<claim uid>/<device>` (eviction never removes a prepared model). A record
is written (durably: kubelet's own checkpoint outlives a reboot, and so must ours) after the leases and the CDI
spec, and removed after both are gone on unprepare.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from weightcache.store.fsops import Tree

log = logging.getLogger(__name__)

HOLDER_PREFIX = "dra:"
MAX_RECORD_BYTES = 1 << 20
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


@dataclass(frozen=True)
class ClaimRecord:
    uid: str
    namespace: str
    name: str
    devices: tuple[PreparedDevice, ...]
    prepared_at: float = 0.0

    def holders(self) -> list[str]:
        return [holder_for(self.uid, d.device) for d in self.devices]


def valid_uid(uid: str) -> bool:
    return bool(_UID.match(uid))


def holder_for(claim_uid: str, device: str) -> str:
    """The store lease holder id of one prepared device."""
    return f"{HOLDER_PREFIX}{claim_uid}/{device}"


def claim_of_holder(holder: str) -> str | None:
    """The claim uid of a `dra:` lease holder, or None for another holder."""
    if not holder.startswith(HOLDER_PREFIX):
        return None
    return holder[len(HOLDER_PREFIX):].partition("/")[0] or None


class ClaimBook:
    """The record files of one store, read and written symlink-safe through the store's Tree; each write is a
    whole file renamed into place."""

    def __init__(self, tree: Tree) -> None:
        self._tree = tree
        self.dir = tree.root / "dra" / "claims"
        tree.ensure_dir(self.dir)

    def _path(self, uid: str) -> Path:
        if not valid_uid(uid):
            raise ValueError(f"claim uid {uid!r} is not a Kubernetes uid")
        return self.dir / f"{uid}.json"

    def get(self, uid: str) -> ClaimRecord | None:
        data = self._tree.read(self._path(uid), limit=MAX_RECORD_BYTES)
        if data is None:
            return None
        try:
            obj = json.loads(data)
            record = ClaimRecord(str(obj["uid"]), str(obj["namespace"]), str(obj["name"]),
                                 tuple(PreparedDevice(**{k: str(v) for k, v in d.items()}) for d in obj["devices"]),
                                 float(obj["prepared_at"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:  # damaged: unknown; kubelet retries
            log.warning("ignoring unreadable DRA claim record for %s: %s", uid, exc)
            return None
        return record if record.uid == uid else None

    def put(self, record: ClaimRecord) -> None:
        self._tree.write_atomic(self._path(record.uid), json.dumps(dataclasses.asdict(record), sort_keys=True).encode())

    def remove(self, uid: str) -> None:
        self._tree.unlink(self._path(uid))

    def uids(self) -> list[str]:
        return sorted(n[:-5] for n in self._tree.listdir(self.dir) if n.endswith(".json") and valid_uid(n[:-5]))
