"""Models of many small files: the per-file path of the fetch engine and the store stays cheap and safe.

Speed is measured in scripts/bench_prefetch.py (--small-only); these tests pin what makes it cheap without
giving anything up: no descriptor held per file, one directory check per plan, nothing planted followed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import errno
import hashlib
import os
import resource
import stat
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.grants import admin, granted
from weightcache import download
from weightcache.errors import (
    HostileKeyError,
    IntegrityError,
    ObjectChangedError,
    SafetensorsHeaderError,
    SourceError,
)
from weightcache.fetch import Fetcher
from weightcache.fetch import publish as fetch_publish
from weightcache.fetch.engine import FEW_FILES
from weightcache.sources import ObjectInfo, open_source
from weightcache.sources.base import OnBytes, Pieces, Source
from weightcache.sources.fsspec import stat_token
from weightcache.store import Store, blobwrite, fsops, verify_snapshot
from weightcache.store import store as store_module
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
    for i in range(500):  # empty files too, more than the headroom: each is created and closed at once
        (tmp_path / "model" / "empty" / f"e{i:03d}").parent.mkdir(exist_ok=True)
        (tmp_path / "model" / "empty" / f"e{i:03d}").write_bytes(b"")
        files[f"empty/e{i:03d}"] = b""
    store = Store(tmp_path / "root")
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
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


def _part(store: Store, name: str, data: bytes, mode: int) -> tuple[Path, str]:
    part = store.partial_dir() / name
    part.write_bytes(data)
    part.chmod(mode)
    return part, hashlib.sha256(data).hexdigest()


@pytest.mark.parametrize("renameat2", [True, False], ids=["renameat2", "link-unlink"])
def test_parts_become_0444_blobs_by_a_move_and_an_existing_blob_wins(tmp_path: Path, renameat2: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A part already 0444 is moved as it is, another is made 0444 first (never through a link); when the blob
    exists, the part is dropped and the blob keeps its inode (dedup). Both with renameat2 and without it."""
    monkeypatch.setattr(fsops, "_renameat2_works", renameat2)
    store = Store(tmp_path / "root")
    ro, ro_sha = _part(store, "ro.part", b"small", 0o444)
    rw, rw_sha = _part(store, "rw.part", b"large", 0o600)
    store.add_blobs([(ro, ro_sha), (rw, rw_sha)], durable=False)
    for sha, data in ((ro_sha, b"small"), (rw_sha, b"large")):
        blob = store.layout.blob(sha)
        assert blob.read_bytes() == data and stat.S_IMODE(blob.stat().st_mode) == 0o444
    inode = store.layout.blob(ro_sha).stat().st_ino
    again, _ = _part(store, "again.part", b"small", 0o444)
    store.add_blobs([(again, ro_sha)])
    assert not again.exists() and store.layout.blob(ro_sha).stat().st_ino == inode
    assert not list(store.partial_dir().iterdir())


@pytest.mark.parametrize("planted", ["symlink", "another file"])
def test_a_part_swapped_while_it_is_moved_is_quarantined_not_a_blob(tmp_path: Path, planted: str,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """The blob must be the regular file checked before the move: a symlink put at the part's path in between,
    or another file (a different inode: the checked one is still linked elsewhere here, so its number is not
    reused), is quarantined and the batch fails, instead of becoming the blob; a link's target is not touched."""
    store = Store(tmp_path / "root")
    part, sha = _part(store, "p.part", b"verified bytes", 0o444)
    secret = tmp_path / "secret"
    secret.write_bytes(b"another tenant's weights")
    real_move = fsops.move_noreplace

    def swap_then_move(src_dir_fd: int, src: str, dst_dir_fd: int, dst: str) -> bool:
        os.link(part, tmp_path / "kept")
        part.unlink()
        if planted == "symlink":
            part.symlink_to(secret)
        else:
            part.write_bytes(b"planted bytes!")
            part.chmod(0o444)
        return real_move(src_dir_fd, src, dst_dir_fd, dst)

    monkeypatch.setattr(store_module, "move_noreplace", swap_then_move)
    with pytest.raises(OSError, match="was replaced while it became blob"):
        store.add_blobs([(part, sha)], durable=False)
    assert not store.has_blob(sha) and not store.layout.blob(sha).is_symlink()
    quarantined, = store.layout.quarantine.iterdir()
    assert quarantined.is_symlink() == (planted == "symlink")
    assert stat.S_IMODE(secret.stat().st_mode) != 0o444 and secret.read_bytes() == b"another tenant's weights"


def test_fetched_small_files_are_created_read_only_and_a_read_only_leftover_is_replaced(tmp_path: Path) -> None:
    """Small parts are created 0444 (their blob's mode, so the move needs no chmod); a 0444 part left by a
    killed run is replaced, not an error, and not written through."""
    files = _small_model(tmp_path / "model", 3)
    store = Store(tmp_path / "root", recover=False)
    ref = parse_ref(f"file://{tmp_path / 'model'}/")
    name = f"{ref.key}.{hashlib.sha256(b'd1/f00001.bin').hexdigest()[:16]}.part"
    stale = store.partial_dir() / name
    stale.write_bytes(b"from a killed run" * 100)
    stale.chmod(0o444)
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    snap = Fetcher(store).ensure(admin(ref))
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files
    for f in snap.files:
        assert stat.S_IMODE((snap.path / f.path).stat().st_mode) == 0o444
    assert outside.read_bytes() == b"keep"


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another user")
def test_a_daemon_that_is_not_root_replaces_a_read_only_leftover_part(tmp_path: Path) -> None:
    """Without root, O_TRUNC on a 0444 part left by a killed run fails with EACCES: the part is removed and
    created again (never written through), so the rerun does not fail on its own leftover."""
    partial = tmp_path / "partial"
    partial.mkdir()
    os.chown(partial, 65534, 65534)
    leftover = partial / "x.part"
    leftover.write_bytes(b"from a killed run")
    os.chown(leftover, 65534, 65534)
    leftover.chmod(0o444)
    code = ("import os, sys; from pathlib import Path; from weightcache.download import _create_truncated\n"
            "os.chdir(sys.argv[1]); os.setgid(65534); os.setuid(65534)\n"  # tmp_path's parents are 0700
            "fd = _create_truncated(Path('x.part')); os.write(fd, b'new'); os.close(fd)")
    subprocess.run([sys.executable, "-c", code, str(partial)], check=True, cwd=Path(__file__).parent.parent)
    assert leftover.read_bytes() == b"new" and stat.S_IMODE(leftover.stat().st_mode) == 0o444


def test_files_recorded_here_are_linked_once_and_fetched_again_once_evicted(tmp_path: Path) -> None:
    """A file this node fetched before (same path, version token and size, from one query for the listing) is
    linked without a download; once its blob is evicted, the record alone is not enough: it is fetched again."""
    files = _small_model(tmp_path / "model", 30)
    store = Store(tmp_path / "root")
    ref = parse_ref(f"file://{tmp_path / 'model'}/")
    first = Fetcher(store).ensure(admin(ref))
    (tmp_path / "model" / "d0" / "f00000.bin").write_bytes(b"changed")  # a new token for this file only
    files["d0/f00000.bin"] = b"changed"
    fetcher = Fetcher(store)
    second = fetcher._fetch(admin(ref), None)
    assert fetcher.stats["origin_bytes"] == len(b"changed"), "only the changed file was read"
    store.evict(first.id)
    store.evict(second.id)
    assert not any(store.layout.blobs.rglob("*")) or all(p.is_dir() for p in store.layout.blobs.rglob("*"))
    third = Fetcher(store)
    snap = third.ensure(admin(ref))
    assert third.stats["origin_bytes"] == sum(len(d) for d in files.values())
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files


class _ThreadRecordingSource(Source):
    """A file:// source that records which threads read and says whether it is local. Each read waits (up to
    10 s) until `expect` threads have read, so every worker the round starts gets a piece however loaded the
    machine is (a round with fewer workers waits out the 10 s and fails the count)."""

    def __init__(self, ref_uri: str, *, local: bool, expect: int) -> None:
        self.inner = open_source(parse_ref(ref_uri))
        self.ref, self.name, self.local, self.expect = self.inner.ref, self.inner.name, local, expect
        self.threads: set[str] = set()
        self._seen = threading.Condition()

    def list(self) -> list[ObjectInfo]:
        return self.inner.list()

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        self.inner.read_into(obj, offset, buf)

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        with self._seen:
            self.threads.add(threading.current_thread().name)
            self._seen.notify_all()
            self._seen.wait_for(lambda: len(self.threads) >= self.expect, timeout=10)
        return self.inner.read_pieces(obj, offset, length, buf, on_bytes)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return None

    def close(self) -> None:
        self.inner.close()


@pytest.mark.parametrize(("local", "sizes", "threads"), [
    (True, [4096] * 40, 1),  # local and small: one worker, no GIL hand-off per system call
    (True, [1 << 20] * 3 + [4096] * 20, 3),  # a worker per large piece
    (False, [4096] * 40, 8),  # requests: every worker hides latency
])
def test_a_local_round_of_small_pieces_runs_on_one_worker(tmp_path: Path, local: bool, sizes: list[int],
                                                          threads: int) -> None:
    """Threads hide request latency; a local source's small reads have none, so they take one worker (8 took
    nearly twice as long as one for 2,000 files of 4 KB), and large local pieces one worker each."""
    model = tmp_path / "model"
    model.mkdir()
    for i, size in enumerate(sizes):
        (model / f"f{i:03d}.bin").write_bytes(os.urandom(size))
    uri = f"file://{model}/"
    source = _ThreadRecordingSource(uri, local=local, expect=threads)
    snap = Fetcher(Store(tmp_path / "root"), concurrency=8, chunk_size=1 << 20,
                   source_factory=lambda ref: source).ensure(granted(uri))
    assert len(snap.files) == len(sizes)
    assert len(source.threads) == threads, source.threads


# -- small files written straight to their blobs (weightcache/store/blobwrite.py) -------------------------------

def _count_parts(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Every part file the fetch creates (download._create_truncated), recorded."""
    made: list[Path] = []
    real = download._create_truncated

    def counting(path: Path) -> int:
        made.append(path)
        return real(path)

    monkeypatch.setattr(download, "_create_truncated", counting)
    return made


def _no_tmpfile(monkeypatch: pytest.MonkeyPatch) -> None:
    """os.open refuses O_TMPFILE as a filesystem without it does (EOPNOTSUPP); every other open goes through."""
    real = os.open

    def refusing(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        if flags & os.O_TMPFILE == os.O_TMPFILE:
            raise OSError(errno.EOPNOTSUPP, "no O_TMPFILE here")
        return real(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", refusing)  # blobwrite calls os.open


def _needs_tmpfile(path: Path) -> None:
    try:
        os.close(os.open(path, os.O_TMPFILE | os.O_RDWR, 0o444))
    except OSError as exc:
        pytest.skip(f"the test filesystem has no O_TMPFILE ({exc.strerror})")


def test_small_files_are_written_straight_to_their_blobs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file read whole is hashed before it is written, so it goes to an unnamed file in its blob directory that
    is linked under its digest: no part is created, every blob is 0444 and holds the bytes its name says."""
    _needs_tmpfile(tmp_path)
    parts = _count_parts(monkeypatch)
    files = _small_model(tmp_path / "model", 60)
    files["dup/copy.bin"] = files["d0/f00000.bin"]  # the same bytes twice: one blob
    (tmp_path / "model" / "dup").mkdir()
    (tmp_path / "model" / "dup" / "copy.bin").write_bytes(files["dup/copy.bin"])
    store = Store(tmp_path / "root")
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
    assert parts == []
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files
    blobs = [p for p in store.layout.blobs.rglob("*") if p.is_file()]
    assert len(blobs) == len(set(files.values()))
    for blob in blobs:
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name
        assert stat.S_IMODE(blob.stat().st_mode) == 0o444 and blob.stat().st_nlink >= 2
    assert verify_snapshot(store, snap.id) == []


@pytest.mark.parametrize("missing", ["O_TMPFILE", "/proc"])
def test_without_o_tmpfile_or_proc_small_files_go_through_parts(tmp_path: Path, missing: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the filesystem refuses O_TMPFILE or /proc is not mounted, small files take the part path as before,
    and the writer stops trying after the first refusal."""
    if missing == "O_TMPFILE":
        _no_tmpfile(monkeypatch)
    else:
        monkeypatch.setattr(blobwrite, "_PROC_FD", str(tmp_path / "no-proc"))
    parts = _count_parts(monkeypatch)
    files = _small_model(tmp_path / "model", 20)
    store = Store(tmp_path / "root")
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
    assert len(parts) == len(files)
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files
    assert verify_snapshot(store, snap.id) == []
    assert not list(store.partial_dir().glob("*.part"))
    with store.blob_writer() as writer:
        assert writer.write(hashlib.sha256(b"x").hexdigest(), memoryview(b"x")) is False
        assert not writer.usable


def test_without_the_privilege_to_link_a_descriptor_blobs_are_named_through_proc(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """linkat(AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH before Linux 6.10: refused once (ENOENT, as the kernel
    says it), every blob is named through /proc/self/fd instead, and it is not asked again."""
    _needs_tmpfile(tmp_path)
    calls: list[int] = []

    class Unprivileged:
        @staticmethod
        def linkat(*args: object) -> int:
            calls.append(1)
            ctypes.set_errno(errno.ENOENT)
            return -1

    monkeypatch.setattr(blobwrite, "_libc", Unprivileged)
    parts = _count_parts(monkeypatch)
    files = _small_model(tmp_path / "model", 20)
    store = Store(tmp_path / "root")
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files
    assert parts == [] and len(calls) == 1
    assert verify_snapshot(store, snap.id) == []


@pytest.mark.parametrize("planted", ["empty", "short", "other bytes", "symlink", "fifo", "directory"])
def test_a_blob_name_holding_other_bytes_is_quarantined_and_replaced(tmp_path: Path, planted: str) -> None:
    """A blob name may reach the disk before its bytes (they are synced once, before publish): one found empty
    or short after a crash, or anything else at the name, is compared with the bytes in hand, quarantined and
    replaced, never trusted; a symlink there is not followed."""
    data = b"the real bytes" * 300
    sha = hashlib.sha256(data).hexdigest()
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(data)
    secret = tmp_path / "secret"
    secret.write_bytes(data[:-1] + b"!")
    store = Store(tmp_path / "root")
    blob = store.layout.blob(sha)
    blob.parent.mkdir(parents=True, exist_ok=True)
    if planted == "symlink":
        blob.symlink_to(secret)
    elif planted == "fifo":
        os.mkfifo(blob)
    elif planted == "directory":
        (blob / "inside").mkdir(parents=True)
    else:
        blob.write_bytes({"empty": b"", "short": data[:100], "other bytes": data[:-1] + b"?"}[planted])
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
    assert (snap.path / "w.bin").read_bytes() == data
    assert not blob.is_symlink() and blob.read_bytes() == data
    assert blob.stat().st_ino == (snap.path / "w.bin").stat().st_ino
    quarantined, = store.layout.quarantine.iterdir()
    assert quarantined.is_symlink() == (planted == "symlink")
    assert secret.read_bytes() == data[:-1] + b"!"


def test_a_blob_that_holds_the_same_bytes_is_kept(tmp_path: Path) -> None:
    """An existing blob with the bytes in hand wins (dedup: one inode), and the unnamed file goes with its
    descriptor."""
    data = b"shared" * 1000
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "w.bin").write_bytes(data)
    store = Store(tmp_path / "root")
    blob = store.layout.blob(hashlib.sha256(data).hexdigest())
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    blob.chmod(0o444)
    inode = blob.stat().st_ino
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
    assert (snap.path / "w.bin").stat().st_ino == inode
    assert not any(store.layout.quarantine.iterdir())


def test_a_small_file_failing_its_check_is_never_named_a_blob(tmp_path: Path) -> None:
    """Verification comes before the name: bytes that do not match the digest SHA256SUMS gives are fetched again,
    then refused, and no blob of them exists."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "w.bin").write_bytes(b"what the source serves")
    (model / "SHA256SUMS").write_text(f"{hashlib.sha256(b'what it claims').hexdigest()}  w.bin\n")
    store = Store(tmp_path / "root")
    with pytest.raises(IntegrityError, match=r"w\.bin: sha256"):
        Fetcher(store).ensure(granted(f"file://{model}/"))
    assert not store.has_blob(hashlib.sha256(b"what the source serves").hexdigest())


def test_a_small_safetensors_file_is_checked_once_before_it_is_named(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The header check reads the unnamed file (through /proc/self/fd): a good one becomes its blob, a bad one
    is refused naming the file (by its path in the model, not the descriptor it was read through), checked
    once (not again after the round, which would start a big header's worker processes twice), no part of it
    written and no blob of it made. A file named a blob is verified once, not again after the round."""
    _needs_tmpfile(tmp_path)
    from weightcache import safetensors_check

    checked: list[str] = []
    check_file = safetensors_check.check_file
    monkeypatch.setattr(safetensors_check, "check_file", lambda path: (checked.append(str(path)), check_file(path)))
    verified: list[str] = []
    verify = fetch_publish.verified
    monkeypatch.setattr(fetch_publish, "verified", lambda item, source: (verified.append(item.relpath),
                                                                         verify(item, source))[1])
    model = tmp_path / "model"
    model.mkdir()
    save_file({"w": np.arange(16, dtype=np.float32)}, str(model / "good.safetensors"))
    (model / "config.json").write_text("{}")
    store = Store(tmp_path / "root")
    snap = Fetcher(store).ensure(granted(f"file://{model}/"))
    assert (snap.path / "good.safetensors").read_bytes() == (model / "good.safetensors").read_bytes()
    assert len(checked) == 1 and sorted(verified) == ["config.json", "good.safetensors"]
    checked.clear()
    bad = tmp_path / "damaged" / "sub" / "bad.safetensors"
    bad.parent.mkdir(parents=True)
    header = b'{"w": {"dtype": "F32", "shape": [1000], "data_offsets": [0, 4000]}}'
    bad.write_bytes(len(header).to_bytes(8, "little") + header + b"\0" * 16)  # 4,000 bytes promised, 16 there
    with pytest.raises(SafetensorsHeaderError) as refused:
        Fetcher(store).ensure(granted(f"file://{tmp_path / 'damaged'}/"))
    assert str(refused.value).startswith("sub/bad.safetensors: invalid safetensors file: "), refused.value
    assert "/proc" not in str(refused.value) and len(checked) == 1 and checked[0].startswith("/proc/self/fd/")
    assert not store.has_blob(hashlib.sha256(bad.read_bytes()).hexdigest())
    assert os.listdir(store.partial_dir()) == []


class _ChecksumSource(Source):
    """A file:// source whose listing carries each file's full-object SHA-256, as S3 gives it."""

    def __init__(self, ref_uri: str) -> None:
        self.inner = open_source(parse_ref(ref_uri))
        self.ref, self.name = self.inner.ref, self.inner.name

    def list(self) -> list[ObjectInfo]:
        return [dataclasses.replace(o, checksum=("sha256", hashlib.sha256(Path(o.key).read_bytes()).hexdigest()))
                for o in self.inner.list()]

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        self.inner.read_into(obj, offset, buf)

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return self.inner.read_pieces(obj, offset, length, buf, on_bytes)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return None

    def close(self) -> None:
        self.inner.close()


def test_a_fetch_that_links_blobs_on_a_checksum_alone_syncs_before_it_publishes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A blob found by the store's checksum may be another fetch's, named before its bytes were synced: a fetch
    that downloads nothing but links such blobs syncs the filesystem once before its manifest promises them."""
    files = _small_model(tmp_path / "model", 10)
    _small_model(tmp_path / "copy", 10)
    store = Store(tmp_path / "root")
    Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
    syncs: list[Path] = []
    monkeypatch.setattr(fetch_publish, "sync_filesystem", syncs.append)
    uri = f"file://{tmp_path / 'copy'}/"  # the same bytes from another source: nothing of it recorded here
    fetcher = Fetcher(store, source_factory=lambda ref: _ChecksumSource(uri))
    snap = fetcher.ensure(granted(uri))
    assert fetcher.stats["origin_bytes"] == 0, "every file linked on its checksum"
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files
    assert len(syncs) == 1


def test_a_peer_is_told_a_whole_file_is_held_only_once_its_part_holds_the_bytes(tmp_path: Path) -> None:
    """hash_whole hashes a one-request file before any byte is written (it may go to its blob, never the part):
    `holds`, which the peer server asks before serving a download in flight, says yes only after
    write_whole_part wrote them, so a part left at that name by an earlier run is never served as this one."""
    data = b"the bytes of this run" * 10
    obj = ObjectInfo("k", "f.bin", len(data), "etag-1", None, None)
    part = download.PartialFile(tmp_path / "f.part", obj, range_size=1 << 20, journalled=False)
    (tmp_path / "f.part").write_bytes(b"stale bytes of an earlier run" * 10)
    part.hash_whole(memoryview(data))
    assert part.complete and not part.holds(0, 1) and not part.holds(0, len(data))
    part.write_whole_part(memoryview(data))
    assert part.holds(0, len(data)) and (tmp_path / "f.part").read_bytes() == data


def test_a_part_and_journal_left_at_a_small_files_name_are_removed_when_it_is_fetched(tmp_path: Path) -> None:
    """A one-request file starts over: what an earlier run left at its part's name (a crash, or a smaller chunk
    size then, with a journal) is removed before the round, not left for a peer to open as in flight."""
    _needs_tmpfile(tmp_path)
    files = _small_model(tmp_path / "model", 3)
    store = Store(tmp_path / "root", recover=False)
    ref = parse_ref(f"file://{tmp_path / 'model'}/")
    stale = store.partial_dir() / f"{ref.key}.{hashlib.sha256(b'd1/f00001.bin').hexdigest()[:16]}.part"
    stale.write_bytes(b"from a killed run" * 100)
    stale.with_suffix(".journal").write_text('{"key": "old"}\n0 1700\n')
    other = store.partial_dir() / "m0000.0123456789abcdef.part"  # another model's download: not ours to remove
    other.write_bytes(b"another model's")
    snap = Fetcher(store).ensure(admin(ref))
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files
    assert not stale.exists() and not stale.with_suffix(".journal").exists()
    assert other.read_bytes() == b"another model's"


def test_publish_names_the_snapshot_only_after_the_syncfs_it_overlaps_returns(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The syncfs that makes a fetch's blobs durable runs while publish links the tree: the tree may be built
    meanwhile, but no manifest, snapshot or ref names it until the syncfs has returned."""
    files = _small_model(tmp_path / "model", 40)
    store = Store(tmp_path / "root")
    seen: dict[str, object] = {}

    def slow_syncfs(path: Path) -> None:
        threading.Event().wait(0.5)  # a slow disk: publish has long built its tree by now
        seen["tree built meanwhile"] = any(p.name.startswith(fsops.TMP_PREFIX)
                                           for p in store.layout.snapshots.iterdir())
        seen["named at its end"] = sorted(p.name for d in (store.layout.manifests, store.layout.refs)
                                          for p in d.iterdir()) + [p.name for p in store.layout.snapshots.iterdir()
                                                                   if not p.name.startswith(fsops.TMP_PREFIX)]

    monkeypatch.setattr(fetch_publish, "sync_filesystem", slow_syncfs)
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'model'}/"))
    assert seen == {"tree built meanwhile": True, "named at its end": []}
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == files


def test_a_syncfs_that_fails_abandons_the_publish_and_leaves_no_tree(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """syncfs failing (EIO: the disk lost writes) means the blobs may not be on disk: the fetch fails with that
    error, the tree publish built meanwhile is removed, and nothing names a snapshot (a model of more than
    FEW_FILES files: fewer are made durable one by one, without a syncfs)."""
    _small_model(tmp_path / "model", FEW_FILES + 8)
    store = Store(tmp_path / "root")

    def failing_syncfs(path: Path) -> None:
        raise OSError(errno.EIO, "syncfs: Input/output error")

    monkeypatch.setattr(fetch_publish, "sync_filesystem", failing_syncfs)
    ref = parse_ref(f"file://{tmp_path / 'model'}/")
    with pytest.raises(OSError, match="Input/output error"):
        Fetcher(store).ensure(admin(ref))
    assert store.lookup(ref) is None
    assert [*store.layout.snapshots.iterdir(), *store.layout.manifests.iterdir()] == []


def test_a_model_of_few_files_is_made_durable_file_by_file_without_a_syncfs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A model of at most FEW_FILES files: each file fsynced with its blob directory by the worker that finished
    it, and the snapshot published without a syncfs (one writes whatever every other writer of the filesystem left
    dirty: 0.08-0.92 s after an 88 MB model on the development VM). Before: two syncfs calls per fetch. More files:
    one syncfs, as before."""
    syncs: list[Path] = []
    monkeypatch.setattr(fetch_publish, "sync_filesystem", syncs.append)
    few = _small_model(tmp_path / "few", FEW_FILES - 2)
    (tmp_path / "few" / "big.bin").write_bytes(big := os.urandom(3 << 20))  # journalled: a part, then its blob
    few["big.bin"] = big
    store = Store(tmp_path / "root")
    snap = Fetcher(store, chunk_size=1 << 20).ensure(granted(f"file://{tmp_path / 'few'}/"))
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == few
    assert all(stat.S_IMODE(store.layout.blob(f.sha256).stat().st_mode) == 0o444 for f in snap.files)
    assert syncs == []
    many = _small_model(tmp_path / "many", FEW_FILES + 1)
    snap = Fetcher(store).ensure(granted(f"file://{tmp_path / 'many'}/"))
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == many
    assert len(syncs) == 1
