"""Growing read-only views of a model that is still downloading: `streams/<volume id>/` (docs/streaming-pods.md).

A streaming CSI volume is bind-mounted read-only on one of these before its snapshot exists. Each file of the
fetch is linked in once it is verified and durable: a hard link to its blob, made in one `link` call, so a reader
sees the whole file or none, and the file never changes after. Beside the files, `.weightcache/state` tells the
pod's loader what to wait for (weightcache/vocabulary.py has its format), replaced whole (tmp + rename).

Every path is walked from the store root without following symlinks (Tree); the relpaths are the listing's
validated ones and are validated again here. A blob linked into a view has two links, so the store's gc of
orphan blobs (which removes only a blob with a single link) leaves it while the view holds it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

from weightcache.errors import ObjectChangedError
from weightcache.store.fsops import LinkTree
from weightcache.store.layout import Layout
from weightcache.store.paths import validate_relpath
from weightcache.vocabulary import STREAM_DIR, STREAM_FETCHING, STREAM_STATE

STATE_DIR_MODE = 0o555


class StreamViews:
    """The views under one store's `streams/`. Not locked: one caller per volume at a time (the CSI plugin's)."""

    def __init__(self, layout: Layout) -> None:
        self._layout = layout
        self._tree = layout.tree
        self.dir = layout.streams

    def path(self, volume_id: str) -> Path:
        return self._layout.stream(volume_id)

    def create(self, volume_id: str, *, state: bool = True) -> Path:
        """A fresh, empty view (whatever stood at its name, a planted link included, is removed first) whose
        state says `fetching` with the files not yet known; with `state=False` no state file (a pod's adapter
        directory, csi/adapters.py: it only grows, by whole directories)."""
        view = self.path(volume_id)
        self._tree.remove_tree(view)
        self._tree.ensure_dir(view)
        if state:
            self.write_state(volume_id, STREAM_FETCHING)
        return view

    def exists(self, volume_id: str) -> bool:
        return self._tree.lstat(self.path(volume_id)) is not None

    def prune(self, keep: Iterable[str]) -> list[str]:
        """Remove every view but those of the volume ids `keep`; the names removed."""
        wanted = {self.path(volume_id).name for volume_id in keep}
        stale = [name for name in self._tree.listdir(self.dir) if name not in wanted]
        for name in stale:
            self._tree.remove_tree(self.dir / name)
        return stale

    def link(self, volume_id: str, relpath: str, sha256: str) -> bool:
        """Link blob `sha256` into the view at `relpath`; False when it is there already (a repeat). A path that
        is there with other bytes raises ObjectChangedError: files of a view never change. Names under the
        view's own `.weightcache/` are never linked (False)."""
        validate_relpath(relpath)
        if relpath.split("/", 1)[0] == STREAM_DIR:
            return False
        view = self.path(volume_id)
        parent, _, name = relpath.rpartition("/")
        blob = self._layout.blob(sha256)
        with self._tree.dir(blob.parent) as src, self._tree.dir(view) as root, \
                LinkTree(root, dir_mode=STATE_DIR_MODE) as links:
            try:
                links.link(src, blob.name, relpath)
                return True
            except FileExistsError:
                there = os.stat(name, dir_fd=links.dir(parent), follow_symlinks=False)
                if there.st_ino == os.stat(blob.name, dir_fd=src, follow_symlinks=False).st_ino:
                    return False
                raise ObjectChangedError(f"{relpath} changed at the source while it was streamed to this pod "
                                         "(the view holds the old bytes); restart the pod to load the new "
                                         "revision") from None

    def write_state(self, volume_id: str, state: str, files: Iterable[str] | None = None,
                    error: str | None = None) -> None:
        """Replace the view's state file (its directory made read-only to everyone but us)."""
        body = {"state": state, "files": sorted(files) if files is not None else None, "error": error}
        path = self.path(volume_id) / STREAM_STATE
        self._tree.write_atomic(path, json.dumps(body).encode(), mode=0o444, durable=False)
        with self._tree.dir(path.parent) as fd:
            os.fchmod(fd, STATE_DIR_MODE)

    def remove(self, volume_id: str) -> None:
        """Remove the view (its blobs stay: a snapshot's, or orphans for gc)."""
        self._tree.remove_tree(self.path(volume_id))
