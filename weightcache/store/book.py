"""Node-state records kept in the store: one JSON file per key in one directory, through the store's no-follow tree.

    <store root>/csi/volumes/<url-quoted volume id>.json   CSI published volumes (weightcache.csi.reconcile)
    <store root>/dra/claims/<claim uid>.json               DRA prepared claims (weightcache.dra.claims)

Anything under the root may have been planted, so every call goes through `Tree` (weightcache/store/fsops.py): the
directories are walked with O_NOFOLLOW (a symlink at `csi/` or `csi/volumes` is quarantined and replaced by a
real directory, never followed), a write is an O_EXCL temp file with an unpredictable name renamed into place, and
a read refuses a symlink or an oversized file. A record that is not what its user parses (disk damage, a hand
edit) is moved to `quarantine/` with a warning and reads as missing: one bad file costs only its own key, and the
callers' reconciliation (mount table, leases, kubelet's retries) decides what to do without it.

Records are versioned, so a rollback never loses what they hold (docs/upgrade.md, "Node-state records"): each is
written with `"version": "MAJOR.MINOR"` (the book's own; a record without one is 1.0, what 0.2.0 and before
wrote). A newer minor only adds fields: an older release reads the fields it knows, keeps the others and writes
them back whenever it rewrites the record (stamped with the higher of the two versions). A newer major is refused
by name (NewerRecordError, a message saying which release wrote it and what to do): the file is neither parsed,
quarantined nor overwritten, and its callers hold its leases (CSI and DRA reconcile keep every lease whose record
file is there, readable or not).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, TypeVar

from weightcache.errors import NewerRecordError
from weightcache.store.fsops import TMP_PREFIX, Tree

log = logging.getLogger(__name__)

T = TypeVar("T")
SUFFIX = ".json"
MAX_RECORD_BYTES = 1 << 20
VERSION = "version"
_VERSION = re.compile(r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$")
Version = tuple[int, int]


class RecordBook:
    """JSON records named `<name>.json` in directory `parts` below the tree's root: objects whose top-level keys
    `fields` this release knows, at record version `version` (major, minor)."""

    def __init__(self, tree: Tree, *parts: str, fields: Iterable[str], version: Version = (1, 0),
                 durable: bool = True, limit: int = MAX_RECORD_BYTES) -> None:
        self._tree = tree
        self._durable = durable
        self._limit = limit
        self._fields = frozenset(fields)
        self.version = version
        self.dir = tree.root.joinpath(*parts)
        tree.ensure_dir(self.dir)

    def path(self, name: str) -> Path:
        """The file of record `name`, which must be one plain file name (the caller made it safe)."""
        if not name or "/" in name or "\0" in name or name.startswith(TMP_PREFIX) or len(name) + len(SUFFIX) > 255:
            raise ValueError(f"{name[:80]!r} cannot name a record file")
        return self.dir / (name + SUFFIX)

    def get(self, name: str, parse: Callable[[Any], T]) -> T | None:
        """`parse` of the record's known fields; None when there is none, or when the file is damaged or `parse`
        refuses it (ValueError, KeyError, TypeError, AttributeError): the file is then quarantined.
        NewerRecordError when a newer major version wrote it (kept as it is)."""
        path = self.path(name)
        read = self._read(path)
        if read is None:
            return None
        known = {k: v for k, v in read[1].items() if k in self._fields}
        try:
            return parse(known)
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            self._tree.quarantine(path, f"is not a valid record ({type(exc).__name__}: {str(exc)[:200]})")
            return None

    def _read(self, path: Path) -> tuple[Version, dict[str, Any]] | None:
        """(version, object without its version) of the file; None when missing or damaged (quarantined)."""
        data = self._tree.read(path, limit=self._limit)  # a symlink or oversized file: quarantined, None
        if data is None:
            return None
        try:
            obj = json.loads(data)
            if not isinstance(obj, dict):
                raise TypeError("not a JSON object")
            version = _parse_version(obj.pop(VERSION, "1.0"))
        except (ValueError, TypeError, RecursionError) as exc:
            self._tree.quarantine(path, f"is not a valid record ({type(exc).__name__}: {str(exc)[:200]})")
            return None
        if version[0] > self.version[0]:
            raise NewerRecordError(
                f"{path} was written by a newer weightcache (record version {version[0]}.{version[1]}; this "
                f"release reads {self.version[0]}.x): it is kept as it is and its leases held; run the release "
                "that wrote it (roll forward), or, once its pod is gone and its mount removed, delete the file")
        return version, obj

    def put(self, name: str, obj: dict[str, Any]) -> None:
        """Write the record whole (readers see the old one or the new one); fsynced unless the book is not
        `durable` (state that a reboot wipes anyway). Fields a newer release wrote into the record there are
        kept (NewerRecordError when a newer major wrote it: never overwritten)."""
        path = self.path(name)
        version, extra = self.version, {}
        read = self._read(path)
        if read is not None:
            version = max(version, read[0])
            extra = {k: v for k, v in read[1].items() if k not in self._fields}
        record = {**extra, **obj, VERSION: f"{version[0]}.{version[1]}"}
        self._tree.write_atomic(path, json.dumps(record, sort_keys=True).encode(), durable=self._durable)

    def remove(self, name: str) -> None:
        self._tree.unlink(self.path(name))

    def names(self) -> list[str]:
        """Names of the records present (temp files of writers in flight left out), sorted."""
        return sorted(n[:-len(SUFFIX)] for n in self._tree.listdir(self.dir)
                      if n.endswith(SUFFIX) and not n.startswith(TMP_PREFIX) and len(n) > len(SUFFIX))

    def all(self, parse: Callable[[Any], T]) -> list[tuple[str, T]]:
        """(name, record) of every readable record; damaged ones are quarantined and left out, and so are those a
        newer major version wrote (kept, with a warning: `newer` names them)."""
        found = []
        for name in self.names():
            try:
                record = self.get(name, parse)
            except NewerRecordError as exc:
                log.warning("%s", exc)
                continue
            if record is not None:
                found.append((name, record))
        return found

    def newer(self) -> set[str]:
        """Names of the records a newer major version wrote (their leases are not this release's to release)."""
        newer = set()
        for name in self.names():
            try:
                self._read(self.path(name))
            except NewerRecordError:
                newer.add(name)
        return newer


def _parse_version(value: object) -> Version:
    match = _VERSION.match(value) if isinstance(value, str) else None
    if match is None:
        raise ValueError(f"record version {str(value)[:40]!r} is not MAJOR.MINOR")
    return int(match[1]), int(match[2])
