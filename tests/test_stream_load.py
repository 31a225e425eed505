"""Tensors before the last byte (weightcache/stream_load.py and Fetcher.ensure's on_file), against moto S3 and a
real store: a shard's tensors come while a later shard is held at the origin, bytes failing verification are
never handed over, the snapshot published is a normal fetch's, and nothing streams without a Grant."""

from __future__ import annotations

import hashlib
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tests.fixtures_s3 import S3
from tests.grants import granted
from tests.sample import make_model
from weightcache.errors import IntegrityError, ObjectChangedError
from weightcache.fetch import DurableFile, Fetcher
from weightcache.sources import ObjectInfo, Source, SourceOptions, open_source
from weightcache.store import Store
from weightcache.stream_load import TensorStream
from weightcache.uri import ModelRef, parse_ref

URI = "s3://models/llama/"
LAST = "model-00004-of-00004.safetensors"


class _HeldSource:
    """The real S3 source, with every read of one file held until `release` is set (the origin's gate)."""

    def __init__(self, inner: Source, held: str, release: threading.Event) -> None:
        self.inner, self.held, self.release = inner, held, release
        self.reads_of_held = 0

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    arrived: Callable[[int], None] | None = None) -> Iterator[tuple[int, memoryview]]:
        if obj.relpath == self.held:
            assert self.release.wait(30), "the held file was never released"
            self.reads_of_held += 1
        return self.inner.read_pieces(obj, offset, length, buf, arrived)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _model(tmp_path: Path) -> Path:
    model = tmp_path / "model"
    make_model(model, layers=4, hidden=64, shards=4)
    # a root shard the index does not name (as Mistral's repos carry consolidated.safetensors beside the
    # shards): the loader's rule leaves it out, so must the stream
    shutil.copy(model / "model-00001-of-00004.safetensors", model / "consolidated.safetensors")
    return model


def _expected(model: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for shard in sorted(model.glob("model-*.safetensors")):
        out.update(load_file(shard))
    return out


def _fetcher(store: Store, s3: S3, wrap: Callable[[Source], Any] = lambda s: s) -> Fetcher:
    def factory(ref: ModelRef) -> Any:
        return wrap(open_source(ref, SourceOptions(endpoint_url=s3.endpoint_url)))
    return Fetcher(store, chunk_size=64 << 10, concurrency=4, source_factory=factory)


def test_first_shard_tensors_arrive_while_the_last_shard_is_held_at_the_origin(tmp_path: Path, s3: S3) -> None:
    model = _model(tmp_path)
    s3.upload_dir(model, "models", "llama/")
    release = threading.Event()
    sources: list[_HeldSource] = []

    def hold(inner: Source) -> _HeldSource:
        sources.append(_HeldSource(inner, LAST, release))
        return sources[-1]

    store = Store(tmp_path / "root")
    stream = TensorStream(_fetcher(store, s3, hold), granted(URI))
    got: dict[str, torch.Tensor] = {}
    it = iter(stream)
    name, tensor = next(it)
    assert not release.is_set() and sources[0].reads_of_held == 0, "no byte of the last shard was read yet"
    assert store.lookup(parse_ref(URI)) is None, "the snapshot is published only when whole"
    got[name] = tensor
    release.set()
    got.update(it)
    want = _expected(model)
    assert got.keys() == want.keys()  # consolidated.safetensors (not in the index) was not loaded
    for key, value in want.items():
        assert torch.equal(got[key], value), key
    # the cache was filled as a side effect, exactly as a normal fetch fills another store
    plain = Fetcher(Store(tmp_path / "plain"), chunk_size=64 << 10,
                    source_factory=lambda ref: open_source(ref, SourceOptions(endpoint_url=s3.endpoint_url)))
    normal = plain.ensure(granted(URI))
    assert stream.snapshot is not None and stream.snapshot.id == normal.id
    assert set(stream.snapshot.files) == set(normal.files)
    assert store.lookup(parse_ref(URI)) == stream.wait()
    for f in normal.files:
        assert (stream.snapshot.path / f.path).read_bytes() == (model / f.path).read_bytes()


def test_on_file_hands_over_each_file_once_verified_and_a_cache_hit_streams_from_the_snapshot(
        tmp_path: Path, s3: S3) -> None:
    model = _model(tmp_path)
    s3.upload_dir(model, "models", "llama/")
    store = Store(tmp_path / "root")
    handed: list[DurableFile] = []
    snap = _fetcher(store, s3).ensure(granted(URI), on_file=handed.append)
    assert sorted(d.entry.path for d in handed) == sorted(f.path for f in snap.files)
    for d in handed:  # each a blob of the store holding exactly the file's bytes, named by their digest
        assert d.blob == store.layout.blob(d.entry.sha256)
        assert d.blob.read_bytes() == (model / d.entry.path).read_bytes()
        assert d.planned == {f.path for f in snap.files}
    hit = TensorStream(_fetcher(store, s3), granted(URI))
    got = dict(hit)
    assert hit.snapshot == snap and got.keys() == _expected(model).keys()


def test_a_shard_failing_verification_is_never_yielded_and_the_stream_raises(tmp_path: Path, s3: S3) -> None:
    model = _model(tmp_path)
    bad = "model-00002-of-00004.safetensors"
    # a sidecar that names other bytes for one shard: both download rounds fail its check
    (model / f"{bad}.sha256").write_text("0" * 64 + f"  {bad}\n")
    s3.upload_dir(model, "models", "llama/")
    store = Store(tmp_path / "root")
    names: list[str] = []
    with pytest.raises(IntegrityError, match=bad):
        for name, _ in TensorStream(_fetcher(store, s3), granted(URI)):
            names.append(name)
    assert names, "the good shards streamed before the fetch failed"
    assert not set(names) & set(load_file(model / bad)), "nothing of the bad shard was yielded"
    assert store.lookup(parse_ref(URI)) is None
    assert not store.layout.blob(hashlib.sha256((model / bad).read_bytes()).hexdigest()).exists()
    assert store.layout.blob(hashlib.sha256((model / LAST).read_bytes()).hexdigest()).exists(), \
        "verified shards stay as blobs for a rerun"


def test_a_stream_takes_only_a_grant(tmp_path: Path, s3: S3) -> None:
    with pytest.raises(TypeError, match="Grant"):
        TensorStream(_fetcher(Store(tmp_path / "root"), s3), parse_ref(URI))  # type: ignore[arg-type]


def test_a_shard_changed_at_the_source_mid_stream_is_never_mixed_with_the_old_ones(tmp_path: Path, s3: S3) -> None:
    """The model is replaced at the source while its last shard is held: the held read finds a new ETag, the
    fetch restarts from a new listing and hands over shards already loaded with other bytes; the stream raises
    rather than yield tensors of two versions, and the fetch goes on to publish the new version."""
    model = _model(tmp_path)
    s3.upload_dir(model, "models", "llama/")
    release = threading.Event()
    store = Store(tmp_path / "root")
    stream = TensorStream(_fetcher(store, s3, lambda inner: _HeldSource(inner, LAST, release)), granted(URI))
    it = iter(stream)
    next(it)
    newer = tmp_path / "newer"
    make_model(newer, layers=4, hidden=64, shards=4, seed=1)
    s3.upload_dir(newer, "models", "llama/")
    release.set()
    with pytest.raises(ObjectChangedError, match="changed at the source while the model was streamed"):
        for _ in it:
            pass
    snap = stream.wait()
    for f in snap.files:
        if f.path.startswith("model-"):
            assert (snap.path / f.path).read_bytes() == (newer / f.path).read_bytes()


def test_a_model_of_small_shards_hands_over_its_index_and_config_before_any_shard(tmp_path: Path, s3: S3) -> None:
    # every file one chunk: the order is the fetch's, not the sizes'. The index sorts after its shards by name
    # ("model-0000…" < "model.safetensors.index.json"), so a name order would hold a streaming loader until the
    # last small shard was in.
    model = _model(tmp_path)
    (model / "config.json").write_text('{"model_type": "llama"}')
    s3.upload_dir(model, "models", "llama/")
    handed: list[str] = []
    fetcher = Fetcher(Store(tmp_path / "root"), chunk_size=16 << 20, concurrency=1,
                      source_factory=lambda ref: open_source(ref, SourceOptions(endpoint_url=s3.endpoint_url)))
    fetcher.ensure(granted(URI), on_file=lambda d: handed.append(d.entry.path))
    shards = [i for i, p in enumerate(handed) if p.endswith(".safetensors")]
    assert handed.index("model.safetensors.index.json") < shards[0], handed
    assert handed.index("config.json") < shards[0], handed
