"""Many files at once: add_blobs and publish open each directory once per batch, not once or twice per file,
and a directory replaced by a symlink mid-store is still never followed."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from weightcache.store import BlobMissingError, Store
from weightcache.store.types import FileEntry
from weightcache.uri import parse_ref

FILES = 300


def _write_parts(store: Store, count: int) -> list[tuple[Path, str, bytes]]:
    parts = []
    for i in range(count):
        data = f"file {i}".encode()
        part = store.layout.partial / f"p{i}.part"
        part.write_bytes(data)
        parts.append((part, hashlib.sha256(data).hexdigest(), data))
    return parts


@pytest.fixture
def opens(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[], list[str]]]:
    """The names passed to os.open from now on (the real call still runs: this only counts)."""
    seen: list[str] = []
    real = os.open

    def counting(path: Any, *args: Any, **kwargs: Any) -> int:
        seen.append(os.fspath(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(os, "open", counting)
    yield lambda: seen


def test_publishing_many_files_opens_each_directory_once(tmp_path: Path,
                                                         opens: Callable[[], list[str]]) -> None:
    store = Store(tmp_path / "root")
    parts = _write_parts(store, FILES)
    prefixes = {sha[:2] for _, sha, _ in parts}
    before = len(opens())
    store.add_blobs((part, sha) for part, sha, _ in parts)
    added = opens()[before:]
    # one open per file (the part, O_NOFOLLOW) plus each directory once: root, partial, blobs, sha256, and each
    # new prefix directory twice (the open that finds it missing, the one after mkdir)
    assert len(added) <= FILES + 2 * len(prefixes) + 5, f"{len(added)} opens for {FILES} files"
    files = [FileEntry(f"dir{i % 7}/f{i}", len(data), sha) for i, (_, sha, data) in enumerate(parts)]
    before = len(opens())
    snap = store.publish(parse_ref("file:///models/many/"), files)
    published = opens()[before:]
    assert sum(1 for name in published if name in prefixes) == len(prefixes), "each blob directory opened once"
    assert len(published) <= len(prefixes) + 60, f"{len(published)} opens to publish {FILES} files"
    for entry, (_, _, data) in zip(files, parts, strict=True):
        assert (snap.path / entry.path).read_bytes() == data
    assert not any(store.layout.partial.glob("p*.part")), "every part became a blob"


def test_a_blob_directory_swapped_for_a_symlink_is_quarantined_not_followed(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    outside = tmp_path / "outside"
    outside.mkdir()
    (part, sha, data), = _write_parts(store, 1)
    (store.layout.blobs / sha[:2]).symlink_to(outside)
    store.add_blobs([(part, sha)])
    assert list(outside.iterdir()) == [], "nothing linked into the symlink's target"
    blob = store.layout.blob(sha)
    assert blob.parent.is_dir() and not blob.parent.is_symlink() and blob.read_bytes() == data
    assert any(store.layout.quarantine.iterdir()), "the planted symlink is kept for inspection"


def test_a_part_that_is_a_symlink_is_refused_and_the_batch_stops(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    secret = tmp_path / "secret"
    secret.write_bytes(b"another tenant's weights")
    (good, good_sha, _), (bad, _, _) = _write_parts(store, 2)
    bad.unlink()
    bad.symlink_to(secret)
    secret_sha = hashlib.sha256(secret.read_bytes()).hexdigest()
    with pytest.raises(OSError):
        store.add_blobs([(good, good_sha), (bad, secret_sha)])
    assert store.has_blob(good_sha) and not store.has_blob(secret_sha)
    assert secret.stat().st_mode & 0o777 != 0o444, "the target was not chmod-ed"


@pytest.mark.parametrize("planted", ["missing", "symlink", "fifo"])
def test_publish_refuses_a_blob_that_vanished_or_is_not_a_regular_file(tmp_path: Path, planted: str) -> None:
    """Publish links what is there under the store lock: a blob gone since add_blobs (gc) or replaced by a
    symlink or FIFO is refused with BlobMissingError (the fetch starts over), and no snapshot, manifest or
    symlink is left where a pod could mount it."""
    store = Store(tmp_path / "root")
    parts = _write_parts(store, 5)
    store.add_blobs((part, sha) for part, sha, _ in parts)
    victim = store.layout.blob(parts[3][1])
    secret = tmp_path / "secret"
    secret.write_bytes(b"another tenant's weights")
    victim.chmod(0o644)
    victim.unlink()
    if planted == "symlink":
        victim.symlink_to(secret)
    elif planted == "fifo":
        os.mkfifo(victim)
    files = [FileEntry(f"d/f{i}", len(data), sha) for i, (_, sha, data) in enumerate(parts)]
    with pytest.raises(BlobMissingError):
        store.publish(parse_ref("file:///models/five/"), files)
    assert not any(store.layout.manifests.iterdir()), "nothing published"
    assert [p.name for p in store.layout.snapshots.iterdir()] == [], "the temporary tree is removed"
    assert store.lookup(parse_ref("file:///models/five/")) is None


def test_publish_refuses_a_digest_that_is_not_one(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    with pytest.raises(BlobMissingError, match="not a sha256 digest"):
        store.publish(parse_ref("file:///models/x/"), [FileEntry("f", 1, "../../etc/passwd")])
    assert not any(store.layout.snapshots.iterdir())
