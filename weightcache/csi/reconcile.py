"""Published-volume records, and their reconciliation with store leases and the kernel's mount table.

Each published volume holds the store lease `csi:<volume_id>` (so eviction never removes a mounted snapshot)
and has a record, written atomically before the mount and removed after the unmount:

    <store root>/csi/volumes/<url-quoted volume_id>.json
    {"volume_id": "csi-8f3a…", "target_path": "/var/lib/kubelet/pods/<uid>/volumes/kubernetes.io~csi/llama/mount",
     "model": "s3://models/llama/", "snapshot_id": "…", "tier": "disk", "pod_namespace": "ml", "pod_name": "vllm-0",
     "pod_uid": "<uid>", "published_at": 1767312000.0}

Records let a restarted plugin answer ALREADY_EXISTS and NodeGetVolumeStats, and let `weightcache evict`
say which pod holds a model. The mount table is the truth: after a restart a record or lease without a
mount is dropped, and a snapshot mount under the kubelet directory without a lease gets one back.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import logging
import os
import re
import time
import urllib.parse
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.csi import mounts
from weightcache.errors import NotCachedError
from weightcache.hf_layout import HF_DIR
from weightcache.store import RecordBook, Store, StreamViews, Tree
from weightcache.store.holders import CSI_RECORD_VERSION, CSI_RECORDS, describe_volume, volume_record_name
from weightcache.store.holders import csi_holder as holder_for
from weightcache.store.layout import STREAMS_DIR
from weightcache.vocabulary import CSI_HOLDER_PREFIX

logger = logging.getLogger(__name__)

# kubelet's target for an inline volume: <kubelet dir>/pods/<pod uid>/volumes/kubernetes.io~csi/<volume name>/mount
_KUBELET_TARGET = re.compile(r"/pods/(?P<uid>[^/]+)/volumes/kubernetes\.io~csi/(?P<name>[^/]+)/mount$")


class VolumeKind(enum.StrEnum):
    """What a volume serves; each kind is published, stated and unpublished by its own part of the plugin."""

    MODEL = "model"  # a snapshot bound read-only (or its hub cache layout): csi/node.py
    ENGINE_CACHE = "engine-cache"  # an engine compile cache, or a scratch read back: csi/engine_volumes.py
    STREAM = "stream"  # a view that fills while the model downloads: csi/stream.py
    ADAPTERS = "adapters"  # a view of the model's LoRA adapters, filled while the pod runs: csi/adapters.py
    REPORT = "report"  # a pod's small writable scratch for its engine's report: csi/engine_volumes.py


@dataclass(frozen=True)
class VolumeRecord:
    volume_id: str
    target_path: str
    model: str  # the reference as published (canonical uri, `@revision` when pinned)
    snapshot_id: str
    tier: str = "disk"
    pod_namespace: str = ""
    pod_name: str = ""
    pod_uid: str = ""
    published_at: float = 0.0
    adopted: bool = False  # rebuilt from the mount table after a restart: pod and revision unknown
    # ENGINE_CACHE: snapshot_id is what its lease keeps (the artifact, or the key's model snapshot). STREAM: the
    # view streams/<volume id>; snapshot_id stays "" (and nothing is leased) until the snapshot is published,
    # and the globs re-make the grant when a restarted plugin resumes filling it
    kind: VolumeKind = VolumeKind.MODEL
    engine_cache: str = ""  # ENGINE_CACHE: the engine's name (`vllm-0.32.0-cpu`)
    handover: bool = False  # ENGINE_CACHE that started empty and writable: read back (csi/engine_volumes.py)
    include: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()

    @property
    def holder(self) -> str:
        return holder_for(self.volume_id)

    def describe(self) -> str:
        return describe_volume(volume_id=self.volume_id, target_path=self.target_path,
                               pod_namespace=self.pod_namespace, pod_name=self.pod_name, pod_uid=self.pod_uid)


def kubelet_volume_id(target_path: str) -> str | None:
    """The id kubelet gives an inline volume (`csi-` + sha256(pod uid + volume name)), read off its target path."""
    match = _KUBELET_TARGET.search(target_path)
    if match is None:
        return None
    return "csi-" + hashlib.sha256((match["uid"] + match["name"]).encode()).hexdigest()


# On disk the kind is what release 1.0 of the record wrote and reads: `engine_cache` set, or `"stream": true`
# (so a rollback still tells a streaming view from a model volume); no field "kind", no new record version. An
# adapter directory alone says `"adapters": true` (a release before it quarantines that record and leaves the
# mount to its reconcile: such a release has no adapter directories to serve); a report volume `"report": true`
# likewise.
_FIELDS = frozenset({f.name for f in dataclasses.fields(VolumeRecord)} - {"kind"} | {"stream", "adapters", "report"})
_STRINGS = ("volume_id", "target_path", "model", "snapshot_id", "tier", "pod_namespace", "pod_name", "pod_uid",
            "engine_cache")


class VolumeBook:
    """The volume records of one store: a RecordBook (weightcache/store/book.py) under `csi/volumes`, read and
    written without following anything planted under the root. Not fsynced: only a power loss would lose a
    record, and a power loss takes every mount with it, so reconcile has nothing to match it to."""

    def __init__(self, store: Tree | str | Path) -> None:
        # a Tree is the store's own (store.tree); a path is resolved as the store resolves its root
        tree = store if isinstance(store, Tree) else Tree(Path(store).resolve())
        self._book = RecordBook(tree, *CSI_RECORDS, fields=_FIELDS, version=CSI_RECORD_VERSION, durable=False)
        self.dir = self._book.dir

    def get(self, volume_id: str) -> VolumeRecord | None:
        """The volume's record; None when there is none, or when it is damaged (then it is quarantined with a
        warning, so a bad file cannot make every call for the volume fail; the mount table decides)."""
        return self._book.get(volume_record_name(volume_id), _parse)

    def find_target(self, target_path: str) -> VolumeRecord | None:
        return next((r for r in self.all() if r.target_path == target_path), None)

    def all(self) -> list[VolumeRecord]:
        return [record for _, record in self._book.all(_parse)]

    def put(self, record: VolumeRecord) -> None:
        wire = dataclasses.asdict(record)
        kind = wire.pop("kind")
        wire["stream"] = kind == VolumeKind.STREAM
        if kind in (VolumeKind.ADAPTERS, VolumeKind.REPORT):
            wire[str(kind)] = True
        self._book.put(volume_record_name(record.volume_id), wire)

    def remove(self, volume_id: str) -> None:
        self._book.remove(volume_record_name(volume_id))

    def newer(self) -> set[str]:
        """Holders of the volumes whose record a newer major version wrote: their leases stay (store/book.py)."""
        return {CSI_HOLDER_PREFIX + urllib.parse.unquote(n) for n in self._book.newer()}


def _parse(obj: Any) -> VolumeRecord:
    """A record read back: exactly VolumeRecord's fields, each of its type (TypeError otherwise: quarantined)."""
    if not isinstance(obj, dict) or not set(obj) <= set(_FIELDS):
        raise TypeError(f"not an object of the fields {sorted(_FIELDS)}")
    for name in ("include", "exclude"):
        globs = obj.get(name, [])
        if not isinstance(globs, list) or not all(isinstance(g, str) for g in globs):
            raise TypeError(f"{name} is not a list of strings")
        obj = {**obj, name: tuple(globs)}
    if not all(isinstance(obj.get(name, ""), str) for name in _STRINGS):
        raise TypeError(f"one of {', '.join(_STRINGS)} is not a string")
    flags = ("adopted", "handover", "stream", "adapters", "report")
    if not all(isinstance(obj.get(flag, False), bool) for flag in flags):
        raise TypeError(f"one of {', '.join(flags)} is not a boolean")
    stream, adapters, report = obj.pop("stream", False), obj.pop("adapters", False), obj.pop("report", False)
    kind = (VolumeKind.ENGINE_CACHE if obj.get("engine_cache") else VolumeKind.STREAM if stream else
            VolumeKind.ADAPTERS if adapters else VolumeKind.REPORT if report else VolumeKind.MODEL)
    record = VolumeRecord(**obj, kind=kind)
    if isinstance(record.published_at, bool) or not isinstance(record.published_at, (int, float)):
        raise TypeError("published_at is not a number")
    return record


@dataclass(frozen=True)
class ReconcileReport:
    kept: tuple[str, ...]  # volume ids mounted and leased
    released: tuple[str, ...]  # holders released: no mount behind them
    adopted: tuple[str, ...]  # volume ids mounted without a lease or record, leased again


def reconcile(store: Store, book: VolumeBook, *, kubelet_dir: str | Path) -> ReconcileReport:
    """Make leases and records agree with the mount table (blocking; run at startup, before serving)."""
    table = mounts.mount_table()
    leases = store.leases()
    kept, released, adopted = [], [], []
    newer = book.newer()  # records this release cannot read: their leases and mounts are left as they are
    for record in book.all():
        entry = mounts.mounted_at(record.target_path, table)
        if entry is not None:
            if record.snapshot_id and leases.get(record.holder) != record.snapshot_id:
                store.lease(record.holder, record.snapshot_id)
            kept.append(record.volume_id)
        else:
            store.release(record.holder)
            book.remove(record.volume_id)
            released.append(record.holder)
    recorded = {holder_for(v) for v in kept}
    for holder in leases:
        if (holder.startswith(CSI_HOLDER_PREFIX) and holder not in recorded and holder not in released
                and holder not in newer):
            store.release(holder)
            released.append(holder)
    known_targets = {r.target_path for r in book.all()}
    for target, snapshot_id in _snapshot_mounts(store, table, Path(kubelet_dir)):
        if target in known_targets:
            continue
        volume_id = kubelet_volume_id(target) or "unknown-" + hashlib.sha256(target.encode()).hexdigest()[:16]
        if holder_for(volume_id) in newer:
            continue
        try:
            snapshot = store.get(snapshot_id)
        except NotCachedError:  # a tree without index row or manifest: store recovery's business, not a lease
            continue
        record = VolumeRecord(volume_id, target, snapshot.uri, snapshot_id, pod_uid=_pod_uid(target),
                              published_at=time.time(), adopted=True)
        store.lease(record.holder, snapshot_id)
        book.put(record)
        adopted.append(volume_id)
    # a view outlives its volume only when a crash came between the unmount and its removal
    StreamViews(store.layout).prune(r.volume_id for r in book.all()
                                    if r.kind in (VolumeKind.STREAM, VolumeKind.ADAPTERS))
    report = ReconcileReport(tuple(kept), tuple(released), tuple(adopted))
    logger.info("CSI reconcile: %d volumes kept, %d leases released, %d mounts adopted",
                len(kept), len(released), len(adopted))
    return report


def _pod_uid(target: str) -> str:
    match = _KUBELET_TARGET.search(target)
    return match["uid"] if match else ""


@dataclass(frozen=True)
class SnapshotMounts:
    """Tells bind mounts of this store's snapshots from other mounts: same device, and a root (the directory of
    the source filesystem mounted there) that is `<snapshots dir>/<id>` of an existing snapshot, or a streaming
    volume's view `<streams dir>/<volume id>`."""

    device: str
    prefix: str  # the snapshots directory as a path inside its filesystem
    snapshots: Path

    @classmethod
    def of(cls, store: Store, table: list[mounts.MountEntry]) -> SnapshotMounts | None:
        snapshots = os.path.realpath(store.root / "snapshots")
        base = max((e for e in table if _within(snapshots, e.mount_point)), key=lambda e: len(e.mount_point),
                   default=None)
        if base is None:
            return None
        prefix = os.path.normpath(os.path.join(base.root, os.path.relpath(snapshots, base.mount_point)))
        return cls(base.device, prefix, store.root / "snapshots")

    def snapshot_id(self, entry: mounts.MountEntry) -> str | None:
        """The snapshot `entry` is a bind mount of, or None when it is not one of ours: `<snapshots>/<id>`, or its
        hub cache layout `<root>/hf/<id>/models--org--name` (weightcache.hf_layout)."""
        parent, _, snapshot_id = entry.root.rpartition("/")
        if parent != self.prefix:  # a hub cache layout?
            is_repo = snapshot_id.startswith("models--")
            hf, _, snapshot_id = parent.rpartition("/")
            if not is_repo or hf != os.path.join(os.path.dirname(self.prefix), HF_DIR):
                return None
        if entry.device == self.device and snapshot_id and (self.snapshots / snapshot_id).is_dir():
            return snapshot_id
        return None

    def is_view(self, entry: mounts.MountEntry) -> bool:
        """Whether `entry` is a bind mount of a streaming volume's view (weightcache/store/streams.py)."""
        parent, _, name = entry.root.rpartition("/")
        return entry.device == self.device and bool(name) and \
            parent == os.path.join(os.path.dirname(self.prefix), STREAMS_DIR)

    def is_ours(self, entry: mounts.MountEntry) -> bool:
        return self.is_view(entry) or self.snapshot_id(entry) is not None


def _snapshot_mounts(store: Store, table: list[mounts.MountEntry], kubelet_dir: Path) -> list[tuple[str, str]]:
    """(target, snapshot id) for each bind mount of one of this store's snapshots under `kubelet_dir`."""
    ours = SnapshotMounts.of(store, table)
    if ours is None:
        return []
    scope = os.path.realpath(kubelet_dir)
    found = []
    for entry in table:
        if not _within(entry.mount_point, scope) or entry.mount_point == scope:
            continue
        snapshot_id = ours.snapshot_id(entry)
        if snapshot_id is not None:
            found.append((entry.mount_point, snapshot_id))
    return found


def _within(path: str, directory: str) -> bool:
    return path == directory or path.startswith(directory.rstrip("/") + "/")
