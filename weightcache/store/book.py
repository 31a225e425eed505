"""Node-state records kept in the store: one JSON file per key in one directory, through the store's no-follow tree.

    <store root>/csi/volumes/<url-quoted volume id>.json   CSI published volumes (weightcache.csi.reconcile)
    <store root>/dra/claims/<claim uid>.json               DRA prepared claims (weightcache.dra.claims)

Anything under the root may have been planted, so every call goes through `Tree` (weightcache/store/fsops.py): the
directories are walked with O_NOFOLLOW (a symlink at `csi/` or `csi/volumes` is quarantined and replaced by a
real directory, never followed), a write is an O_EXCL temp file with an unpredictable name renamed into place, and
a read refuses a symlink or an oversized file. A record that is not what its user parses (disk damage, a hand
edit) is moved to `quarantine/` with a warning and reads as missing: one bad file costs only its own key, and the
callers' reconciliation (mount table, leases, kubelet's retries) decides what to do without it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from weightcache.store.fsops import TMP_PREFIX, Tree

log = logging.getLogger(__name__)

T = TypeVar("T")
SUFFIX = ".json"
MAX_RECORD_BYTES = 1 << 20


class RecordBook:
    """JSON records named `<name>.json` in directory `parts` below the tree's root."""

    def __init__(self, tree: Tree, *parts: str, durable: bool = True, limit: int = MAX_RECORD_BYTES) -> None:
        self._tree = tree
        self._durable = durable
        self._limit = limit
        self.dir = tree.root.joinpath(*parts)
        tree.ensure_dir(self.dir)

    def path(self, name: str) -> Path:
        """The file of record `name`, which must be one plain file name (the caller made it safe)."""
        if not name or "/" in name or "\0" in name or name.startswith(TMP_PREFIX) or len(name) + len(SUFFIX) > 255:
            raise ValueError(f"{name[:80]!r} cannot name a record file")
        return self.dir / (name + SUFFIX)

    def get(self, name: str, parse: Callable[[Any], T]) -> T | None:
        """`parse` of the record's JSON; None when there is none, or when the file is damaged or `parse` refuses
        it (ValueError, KeyError, TypeError, AttributeError): the file is then quarantined."""
        path = self.path(name)
        data = self._tree.read(path, limit=self._limit)  # a symlink or oversized file: quarantined, None
        if data is None:
            return None
        try:
            return parse(json.loads(data))
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
            self._tree.quarantine(path, f"is not a valid record ({type(exc).__name__}: {str(exc)[:200]})")
            return None

    def put(self, name: str, obj: Any) -> None:
        """Write the record whole (readers see the old one or the new one); fsynced unless the book is not
        `durable` (state that a reboot wipes anyway)."""
        self._tree.write_atomic(self.path(name), json.dumps(obj, sort_keys=True).encode(), durable=self._durable)

    def remove(self, name: str) -> None:
        self._tree.unlink(self.path(name))

    def names(self) -> list[str]:
        """Names of the records present (temp files of writers in flight left out), sorted."""
        return sorted(n[:-len(SUFFIX)] for n in self._tree.listdir(self.dir)
                      if n.endswith(SUFFIX) and not n.startswith(TMP_PREFIX) and len(n) > len(SUFFIX))

    def all(self, parse: Callable[[Any], T]) -> list[tuple[str, T]]:
        """(name, record) of every readable record; damaged ones are quarantined and left out."""
        found = []
        for name in self.names():
            record = self.get(name, parse)
            if record is not None:
                found.append((name, record))
        return found
