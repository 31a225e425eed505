"""Tensors before the last byte: fetch a model into the store and load each shard as soon as it is durable.

    stream = TensorStream(fetcher, grant)            # a Grant, as everything that reaches the fetch engine
    for name, tensor in stream:                      # shard by shard while the rest downloads
        ...
    stream.snapshot                                  # the published snapshot, once the loop ended

The fetch runs on a thread of its own (`Fetcher.ensure(on_file=...)`); each file it hands over is verified
(in-order sha256 of every byte, the source's check, its safetensors header) and a durable blob of the store, and
each safetensors shard is then mapped and turned into tensors by the pods' loader (`weightcache.loader
.iter_tensors`: zero-copy copy-on-write views on cpu, pinned copies on cuda). The snapshot is published only
when the whole model is; the cache is filled as a side effect. Which shards are loaded follows the loader's own
rule for a directory: those `model.safetensors.index.json` at the model's root names (shards wait until the index
is in hand), else every `*.safetensors` at the root. A stream that stops early (a `break`) leaves the fetch
running on its thread to fill the cache; `wait()` returns its snapshot.

Above the fetch engine and beside the CLI (docs/architecture.md): the pods' `loader` stays off the store.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from weightcache.access import Grant, require_grant
from weightcache.errors import ModelFileNotFoundError, ModelLayoutError, ObjectChangedError
from weightcache.fetch import DurableFile, Fetcher
from weightcache.loader import INDEX_NAME, _layout, _weight_map, iter_tensors
from weightcache.progress import Progress
from weightcache.store import Snapshot

__all__ = ["TensorStream"]


class TensorStream:
    """Iterate once for (name, tensor) of every tensor of the granted model, shard by shard as each is durable."""

    def __init__(self, fetcher: Fetcher, grant: Grant, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, copy: bool = False,
                 progress: Callable[[Progress], None] | None = None) -> None:
        self._grant = require_grant(grant)  # a door that did not ask is a TypeError here, before any byte moves
        self._fetcher, self._progress = fetcher, progress
        self._device, self._dtype, self._copy = device, dtype, copy
        self._events: queue.SimpleQueue[DurableFile | Snapshot | BaseException] = queue.SimpleQueue()
        self._done = threading.Event()
        self._thread: threading.Thread | None = None
        self._result: Snapshot | BaseException | None = None
        self.snapshot: Snapshot | None = None

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        if self._thread is not None:
            raise RuntimeError("a TensorStream is iterated once; make another (a second one is a cache hit)")
        self._thread = threading.Thread(target=self._fetch, name="wc-stream-fetch", daemon=True)
        self._thread.start()
        return self._tensors()

    def wait(self) -> Snapshot:
        """The published snapshot once the fetch ends (its error, raised, when it failed)."""
        if self._thread is None:
            for _ in self:
                pass
        self._done.wait()
        if isinstance(self._result, BaseException):
            raise self._result
        assert self._result is not None
        return self._result

    def _fetch(self) -> None:
        try:
            self._result = self._fetcher.ensure(self._grant, progress=self._progress, on_file=self._events.put)
        except BaseException as exc:  # handed to the consumer's thread, raised there
            self._result = exc
        self._events.put(self._result)
        self._done.set()

    def _tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        loaded: dict[str, str] = {}  # relpath -> sha256 of each shard loaded
        names: set[str] = set()
        held: list[DurableFile] = []  # root shards that wait for the index to say whether they are the model's
        index: dict[str, frozenset[str]] | None = None  # shard -> its tensors, once the index is in hand
        while True:
            event = self._events.get()
            if isinstance(event, BaseException):
                raise event
            if isinstance(event, Snapshot):
                break
            path = event.entry.path
            if path in loaded:
                if loaded[path] != event.entry.sha256:
                    raise ObjectChangedError(f"{path} changed at the source while the model was streamed (its "
                                            f"tensors were loaded already); load the model again")
                continue
            if path == INDEX_NAME:
                index = _shards(event.blob, event.planned)
                ready, held = held, []
            elif "/" not in path and path.endswith(".safetensors"):
                if INDEX_NAME in event.planned and index is None:
                    held.append(event)
                    continue
                ready = [event]
            else:
                continue
            for shard in ready:
                if index is None or shard.entry.path in index:
                    yield from self._load(shard.blob, shard.entry.path, index, names)
                    loaded[shard.entry.path] = shard.entry.sha256
        self.snapshot = event
        yield from self._rest(event, loaded, index, names)

    def _load(self, blob: Path, path: str, index: dict[str, frozenset[str]] | None,
              names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """One shard's tensors, checked as the loader checks a directory: no tensor in two files, every tensor
        the index maps to this shard present."""
        got = set()
        for name, tensor in iter_tensors(blob, device=self._device, dtype=self._dtype, copy=self._copy):
            if name in names:
                raise ModelLayoutError(f"tensor {name!r} appears in more than one file ({path} and another); keep "
                                       f"one copy or add a {INDEX_NAME}")
            names.add(name)
            got.add(name)
            yield name, tensor
        absent = (index or {}).get(path, frozenset()) - got
        if absent:
            raise ModelLayoutError(f"the index maps {len(absent)} tensors to {path}, which does not hold them, e.g. "
                                   f"{sorted(absent)[:3]}; re-fetch the model or fix the index")

    def _rest(self, snap: Snapshot, loaded: dict[str, str], index: dict[str, frozenset[str]] | None,
              names: set[str]) -> Iterator[tuple[str, torch.Tensor]]:
        """The published snapshot decides: shards it holds that were not handed over (members of an oci tar
        layer) are loaded from it; what was loaded must be its bytes and its shards."""
        layout = {p.name: tensors for p, tensors in _layout(snap.path).items()}  # ModelLayoutError when none
        digests = {f.path: f.sha256 for f in snap.files}
        for path, sha in loaded.items():
            if path not in layout or digests.get(path) != sha:
                raise ObjectChangedError(f"{path} was loaded while streaming but the published snapshot "
                                         f"{snap.id[:12]} {'holds other bytes' if path in layout else 'leaves it out'}"
                                         f"; load the model from the snapshot ({snap.path})")
        for path in sorted(layout.keys() - loaded.keys()):
            yield from self._load(snap.path / path, path, {path: layout[path]}, names)


def _shards(index_blob: Path, planned: frozenset[str]) -> dict[str, frozenset[str]]:
    """The index's shard -> tensors (read by the loader's own parser, with its size and shape limits)."""
    by_shard: dict[str, set[str]] = {}
    for tensor, shard in _weight_map(index_blob).items():
        if "/" in shard or shard in ("", ".", "..") or "\0" in shard:
            raise ModelLayoutError(f"{INDEX_NAME}: shard name {shard!r} must be a file name inside the model "
                                   f"directory")
        by_shard.setdefault(shard, set()).add(tensor)
    absent = sorted(by_shard.keys() - planned)
    if absent:
        raise ModelFileNotFoundError(f"{INDEX_NAME} names shard {absent[0]!r}, which the model at the source does "
                                     f"not hold; fix the index or the model")
    return {shard: frozenset(t) for shard, t in by_shard.items()}
