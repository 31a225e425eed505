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

from weightcache.fetch import Fetcher
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
