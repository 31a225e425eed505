"""Models of many small files: the per-file path of the fetch engine and the store stays cheap and safe.

Speed is measured in scripts/bench_prefetch.py (--small-only); these tests pin what makes it cheap without
giving anything up: no descriptor held per file, one directory check per plan, nothing planted followed.
"""

from __future__ import annotations

import hashlib
import os
import resource
from collections.abc import Iterator
from pathlib import Path

import pytest

from weightcache.errors import HostileKeyError, ObjectChangedError, SourceError
from weightcache.fetch import Fetcher
from weightcache.sources import open_source
from weightcache.sources.fsspec import stat_token
from weightcache.store import Store, verify_snapshot
from weightcache.uri import parse_ref


def _small_model(root: Path, count: int, dirs: int = 5) -> dict[str, bytes]:
    files = {}
    for i in range(count):
        rel = f"d{i % dirs}/f{i:05d}.bin"
        data = hashlib.sha256(str(i).encode()).digest() * (1 + i % 7)
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
        files[rel] = data
    return files


@pytest.fixture
def few_descriptors() -> Iterator[int]:
    """Lower this process's descriptor limit to what is open now plus 400 (the store holds up to 256 blob
    directories open while it links a batch); restored afterwards."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    limit = len(os.listdir("/proc/self/fd")) + 400
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, hard))
    try:
        yield limit
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_a_model_of_more_files_than_descriptors_is_fetched(tmp_path: Path, few_descriptors: int) -> None:
    """A small file's descriptor is closed once it is written: a node's open-file limit never caps the number of
    files a model may have (it held one per file until verification, so 1,000 files failed with EMFILE here)."""
    files = _small_model(tmp_path / "model", 1000)
    store = Store(tmp_path / "root")
    snap = Fetcher(store).ensure(parse_ref(f"file://{tmp_path / 'model'}/"))
    got = {f.path: (snap.path / f.path).read_bytes() for f in snap.files}
    assert got == files
    assert verify_snapshot(store, snap.id) == []


def test_the_local_listing_confines_a_symlink_in_a_subdirectory(tmp_path: Path) -> None:
    """Only symlink entries are resolved now (real directories are walked, a symlinked one is not descended):
    a link deep in the tree that leads out is still refused, naming the key."""
    model = tmp_path / "model"
    _small_model(model, 10)
    (tmp_path / "secret").write_bytes(b"another tenant's weights")
    (model / "d3" / "deep").mkdir()
    (model / "d3" / "deep" / "w.bin").symlink_to(tmp_path / "secret")
    with pytest.raises(HostileKeyError, match=r"d3/deep/w\.bin.*leads outside"):
        open_source(parse_ref(f"file://{model}/")).list()


def test_the_local_listing_refuses_a_fifo(tmp_path: Path) -> None:
    model = tmp_path / "model"
    _small_model(model, 3)
    os.mkfifo(model / "d1" / "pipe")
    with pytest.raises(SourceError, match=r"d1/pipe is not a regular file"):
        open_source(parse_ref(f"file://{model}/")).list()


def test_a_file_swapped_for_a_fifo_after_listing_is_a_change_not_a_hang(tmp_path: Path) -> None:
    """A read opens the path without blocking: a FIFO put there after listing (nobody writes to it) raises
    ObjectChangedError at once instead of hanging the worker in open()."""
    model = tmp_path / "model"
    _small_model(model, 3)
    source = open_source(parse_ref(f"file://{model}/"))
    obj = next(o for o in source.list() if o.relpath == "d1/f00001.bin")
    os.unlink(obj.key)
    os.mkfifo(obj.key)
    with pytest.raises(ObjectChangedError):
        source.read_into(obj, 0, memoryview(bytearray(obj.size)))


def test_the_local_listing_walks_real_directories_with_exact_tokens(tmp_path: Path) -> None:
    """Every file of every real directory, each pinned by its own stat (inode, ctime, mtime, size in ns)."""
    model = tmp_path / "model"
    files = _small_model(model, 40, dirs=4)
    (model / "d2" / "x" / "y").mkdir(parents=True)
    (model / "d2" / "x" / "y" / "z.bin").write_bytes(b"z")
    files["d2/x/y/z.bin"] = b"z"
    objects = open_source(parse_ref(f"file://{model}/")).list()
    assert [o.relpath for o in objects] == sorted(files)
    for o in objects:
        st = os.stat(model / o.relpath)
        assert (o.key, o.size, o.etag) == (str(model / o.relpath), len(files[o.relpath]), stat_token(st))
