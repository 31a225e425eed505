"""Many files at once: add_blobs and publish open each directory once per batch, not once or twice per file,
and a directory replaced by a symlink mid-store is still never followed."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from weightcache.store import BlobMissingError, Store, fsops
from weightcache.store import store as store_module
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


@pytest.mark.parametrize("in_order", [True, False], ids=["ordered-log", "other"])
def test_a_tree_is_fsynced_once_where_the_filesystem_commits_in_order(tmp_path: Path, in_order: bool,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Every fsync flushes the disk's cache: where one commits every earlier change (ext4 with a journal, xfs),
    publish fsyncs the tree's top directory, changed last; elsewhere each directory of the tree."""
    store = Store(tmp_path / "root")
    parts = _write_parts(store, 40)
    store.add_blobs((part, sha) for part, sha, _ in parts)
    files = [FileEntry(f"d{i % 4}/e{i % 3}/f{i}", len(data), sha) for i, (_, sha, data) in enumerate(parts)]
    monkeypatch.setattr(store_module, "commits_in_order", lambda fd: in_order)
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    snap = store.publish(parse_ref("file:///models/tree/"), files)
    in_tree = [p for p in synced if "/snapshots/.tmp-" in p]
    tree_dirs = 1 + 4 + 4 * 3
    assert len(in_tree) == (1 if in_order else tree_dirs), in_tree
    assert in_tree[-1].endswith(snap.id) or ".tmp-" + snap.id in in_tree[-1], "the top directory is fsynced last"
    assert sorted(f.path for f in snap.files) == sorted(f.path for f in files)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("mkfs.ext4") is None, reason="needs root and mkfs.ext4")
@pytest.mark.parametrize(("features", "expected"), [((), True), (("-O", "^has_journal"), False)],
                         ids=["journal", "no-journal"])
def test_an_ext4_with_a_journal_is_known_to_commit_in_order(tmp_path: Path, features: tuple[str, ...],
                                                            expected: bool) -> None:
    """The check that lets publish fsync one directory: a loop-mounted ext4 with its journal says yes, the same
    without a journal (each directory must then be fsynced) says no."""
    image, mnt = tmp_path / "fs.img", tmp_path / "mnt"
    mnt.mkdir()
    with image.open("wb") as f:
        f.truncate(32 << 20)
    subprocess.run(["mkfs.ext4", "-q", *features, str(image)], check=True)
    if subprocess.run(["mount", "-o", "loop", str(image), str(mnt)], check=False).returncode:
        pytest.skip("cannot loop-mount here")
    try:
        fd = os.open(mnt, os.O_RDONLY | os.O_DIRECTORY)
        try:
            assert fsops.commits_in_order(fd) is expected
        finally:
            os.close(fd)
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
