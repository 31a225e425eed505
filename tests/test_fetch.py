"""The fetch engine against a real S3 server (moto on 127.0.0.1), through a fault-injecting proxy."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import threading
from pathlib import Path

import pytest

from tests.command import start_weightcache
from tests.fixtures_daemon import wait_until
from tests.grants import granted
from tests.sample import make_model
from weightcache.errors import HostileKeyError, InsufficientSpaceError, IntegrityError, SafetensorsHeaderError
from weightcache.fetch import Fetcher
from weightcache.store import Store, verify_snapshot
from weightcache.uri import parse_ref

CHUNK = 64 << 10


@pytest.fixture
def model(tmp_path: Path) -> Path:
    make_model(tmp_path / "model", layers=2, hidden=128, shards=2)
    return tmp_path / "model"


def _fetcher(root: Path, endpoint: str, **kw: object) -> Fetcher:
    return Fetcher(Store(root), chunk_size=CHUNK, endpoint_url=endpoint, **kw)


def _same_tree(snap_path: Path, src: Path) -> bool:
    files = sorted(p.relative_to(src).as_posix() for p in src.rglob("*") if p.is_file())
    got = sorted(p.relative_to(snap_path).as_posix() for p in snap_path.rglob("*") if p.is_file())
    return files == got and all((snap_path / f).read_bytes() == (src / f).read_bytes() for f in files)


def _origin_get_bytes(proxy, path: str = "") -> int:
    return sum(b - a + 1 for a, b in proxy.ranges_for(path))


def test_fetch_from_s3_is_exact_and_pinned_with_if_match(tmp_path: Path, s3, fault_proxy, model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    snap = _fetcher(tmp_path / "root", fault_proxy.endpoint_url).ensure(granted("s3://models/llama/"))
    assert _same_tree(snap.path, model)
    gets = [r for r in fault_proxy.requests_for("GET", "/models/llama/") if r.range]
    assert gets and all(r.if_match for r in gets), "every ranged GET must be pinned to the listed ETag"


def test_two_revisions_share_blobs_and_only_changed_files_are_fetched(tmp_path: Path, s3, fault_proxy,
                                                                     model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    f = _fetcher(tmp_path / "root", fault_proxy.endpoint_url)
    first = f.ensure(granted("s3://models/llama/"))
    s3.put("models", "llama/config.json", b'{"v": 2}\n')
    # a new listing for the same model is a new ref name: ask for the current content by its revision digest
    from weightcache.fetch import source_revision
    from weightcache.sources import open_source

    src = open_source(parse_ref("s3://models/llama/"), endpoint_url=fault_proxy.endpoint_url)
    rev = source_revision(src.list())[:12]
    src.close()
    fault_proxy.clear()
    second = f.ensure(granted(f"s3://models/llama/@{rev}"))
    assert second.id != first.id
    fetched = {r.path for r in fault_proxy.requests_for("GET") if r.range}
    assert fetched == {"/models/llama/config.json"}, "unchanged files (same ETag and size) must not be refetched"
    shared = {x.sha256 for x in first.files} & {x.sha256 for x in second.files}
    assert len(shared) == len(first.files) - 1
    assert len([p for p in f.store.layout.blobs.rglob("*") if p.is_file()]) == len(first.files) + 1


def test_throttling_and_resets_and_short_bodies_are_retried(tmp_path: Path, s3, fault_proxy, model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    fault_proxy.add("slowdown", method="GET", ranged_only=True, count=2)
    fault_proxy.add("reset", method="GET", ranged_only=True, count=1, keep=0.3)
    fault_proxy.add("truncate", method="GET", ranged_only=True, count=1, keep=0.5)
    fault_proxy.add("status", method="GET", ranged_only=True, count=1, status=500, code="InternalError")
    snap = _fetcher(tmp_path / "root", fault_proxy.endpoint_url).ensure(granted("s3://models/llama/"))
    assert _same_tree(snap.path, model)
    assert all(fault.fired == fault.count for fault in fault_proxy.faults)


def test_flipped_byte_is_detected_by_md5_etag_and_refetched(tmp_path: Path, s3, fault_proxy, model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    target = "/models/llama/model-00001-of-00002.safetensors"
    flip = fault_proxy.add("flip", method="GET", path=target, ranged_only=True, count=1, at=100)
    snap = _fetcher(tmp_path / "root", fault_proxy.endpoint_url).ensure(granted("s3://models/llama/"))
    assert flip.fired == 1
    assert _same_tree(snap.path, model)
    size = (model / target.rsplit("/", 1)[1]).stat().st_size
    assert _origin_get_bytes(fault_proxy, target) == 2 * size, "the damaged file must be fetched again, once"


def test_corruption_that_persists_fails_with_integrity_error_and_publishes_nothing(tmp_path: Path, s3, fault_proxy,
                                                                                  model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    fault_proxy.add("flip", method="GET", path="config.json", ranged_only=True, count=-1, at=1)
    f = _fetcher(tmp_path / "root", fault_proxy.endpoint_url)
    with pytest.raises(IntegrityError, match=r"config\.json"):
        f.ensure(granted("s3://models/llama/"))
    assert f.store.list() == []
    assert list(f.store.layout.snapshots.iterdir()) == []


def test_sha256_checksum_from_s3_is_verified(tmp_path: Path, s3, fault_proxy, model: Path) -> None:
    for p in sorted(model.iterdir()):
        s3.put("models", f"llama/{p.name}", p.read_bytes(), ChecksumAlgorithm="SHA256")
    snap = _fetcher(tmp_path / "root", fault_proxy.endpoint_url).ensure(granted("s3://models/llama/"))
    assert _same_tree(snap.path, model)


def test_sidecar_sha256_mismatch_is_refused(tmp_path: Path, s3, model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    s3.put("models", "llama/config.json.sha256", b"0" * 64 + b"  config.json\n")
    with pytest.raises(IntegrityError, match=r"config\.json"):
        _fetcher(tmp_path / "root", s3.endpoint_url).ensure(granted("s3://models/llama/"))


def test_object_replaced_mid_download_restarts_and_never_mixes(tmp_path: Path, s3, fault_proxy, model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    name = "model-00001-of-00002.safetensors"
    new_body = (model / "model-00002-of-00002.safetensors").read_bytes()
    hold = fault_proxy.add("hold", method="GET", path=name, ranged_only=True, count=1)
    replaced = threading.Event()

    def replace() -> None:  # while the first ranged GET of the file waits in the proxy, replace the object
        assert hold.arrived.wait(60)
        s3.put("models", f"llama/{name}", new_body)
        replaced.set()
        hold.release.set()

    t = threading.Thread(target=replace)
    t.start()
    snap = _fetcher(tmp_path / "root", fault_proxy.endpoint_url, concurrency=2).ensure(granted("s3://models/llama/"))
    t.join()
    assert replaced.is_set()
    assert (snap.path / name).read_bytes() == new_body, "a body mixed from two object versions was published"
    assert any(r.if_match for r in fault_proxy.requests_for("GET", name))


def test_hostile_keys_from_s3_are_refused_and_nothing_written_outside(tmp_path: Path, s3, model: Path) -> None:
    for key in ["evil/../../x", "evil//abs", "evil/" + "n" * 256]:
        s3.put("hostile", "evil/config.json", b"{}")
        s3.put("hostile", key, b"owned")
        f = _fetcher(tmp_path / "root", s3.endpoint_url)
        with pytest.raises(HostileKeyError):
            f.ensure(granted("s3://hostile/evil/"))
        s3.client.delete_object(Bucket="hostile", Key=key)
    assert not (tmp_path / "x").exists() and not Path("/abs").exists()
    assert list((tmp_path / "root" / "snapshots").iterdir()) == []
    s3.put("hostile", "evil/a", b"file")
    s3.put("hostile", "evil/a/b", b"file below a file")
    with pytest.raises(HostileKeyError, match="both a file and a directory"):
        _fetcher(tmp_path / "root", s3.endpoint_url).ensure(granted("s3://hostile/evil/"))


@pytest.mark.parametrize("header", [
    b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 32]}}',  # extent past the data
    b'{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}}',  # shape x dtype != extent
    b'{"w": {"dtype": "X99", "shape": [1], "data_offsets": [0, 16]}}',  # unknown dtype
    b"not json at all",
])
def test_malicious_safetensors_header_is_refused_before_publish(tmp_path: Path, s3, header: bytes) -> None:
    body = struct.pack("<Q", len(header)) + header + b"\0" * 16
    s3.put("models", "bad/model.safetensors", body)
    s3.put("models", "bad/config.json", b"{}")
    f = _fetcher(tmp_path / "root", s3.endpoint_url)
    with pytest.raises(SafetensorsHeaderError, match=r"model\.safetensors"):
        f.ensure(granted("s3://models/bad/"))
    assert f.store.list() == [] and list(f.store.layout.snapshots.iterdir()) == []
    assert not list(f.store.layout.partial.glob("*.part")), "a refused file's partial must not be kept for a retry"
    assert f.store.has_blob(hashlib.sha256(b"{}").hexdigest()), "a verified file is kept as a blob for the rerun"


def test_huge_header_length_is_refused(tmp_path: Path, s3) -> None:
    s3.put("models", "bad/model.safetensors", struct.pack("<Q", 1 << 60) + b"{}")
    with pytest.raises(SafetensorsHeaderError):
        _fetcher(tmp_path / "root", s3.endpoint_url).ensure(granted("s3://models/bad/"))


_PREFETCH = ["prefetch", "--no-daemon", "-o", "json"]


def test_single_flight_across_three_processes(tmp_path: Path, s3, fault_proxy, model: Path) -> None:
    s3.upload_dir(model, "models", "llama/")
    fault_proxy.add("delay", method="GET", ranged_only=True, count=6, seconds=0.2)
    root = tmp_path / "root"
    cmd = [*_PREFETCH, "s3://models/llama/", "--root", str(root), "--endpoint-url", fault_proxy.endpoint_url,
           "--chunk-size", str(CHUNK)]
    procs = [start_weightcache(*cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], outs
    ids = {json.loads(o[0].strip().splitlines()[-1])["id"] for o in outs}
    assert len(ids) == 1
    model_bytes = sum(p.stat().st_size for p in model.iterdir())
    assert _origin_get_bytes(fault_proxy) == model_bytes, ("three processes must cause exactly one download",
                                                           [o[1] for o in outs])  # their stderr: what each did


@pytest.mark.e2e
def test_kill_9_mid_download_resumes_without_refetching_journalled_ranges(tmp_path: Path, s3, fault_proxy) -> None:
    src = tmp_path / "big"
    make_model(src, layers=2, hidden=256, shards=1)  # one ~7 MB file: > 100 chunks
    s3.upload_dir(src, "models", "big/")
    fault_proxy.add("delay", method="GET", ranged_only=True, count=-1, seconds=0.05)
    root = tmp_path / "root"
    concurrency = 2
    cmd = [*_PREFETCH, "s3://models/big/", "--root", str(root), "--endpoint-url", fault_proxy.endpoint_url,
           "--chunk-size", str(CHUNK), "--concurrency", str(concurrency)]
    proc = start_weightcache(*cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    journal = wait_until(lambda: next((j for j in root.glob("partial/*.journal")  # the header and > 10 chunks
                                       if len(j.read_text().splitlines()) > 11), None),
                         timeout=60, what="the download to journal 10 chunks", every=0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    journalled = [tuple(map(int, line.split())) for line in journal.read_text().splitlines()[1:]
                  if len(line.split()) == 2]
    fault_proxy.clear()
    snap = _fetcher(root, fault_proxy.endpoint_url).ensure(granted("s3://models/big/"))
    assert _same_tree(snap.path, src)
    asked = fault_proxy.ranges_for("/models/big/model.safetensors")
    for a, b in asked:  # requests are [a, b] inclusive; journal entries are (offset, length)
        assert not any(a < off + n and off <= b for off, n in journalled), f"journalled bytes refetched: {a}-{b}"
    size = (src / "model.safetensors").stat().st_size
    kept = sum(n for _, n in journalled)
    assert kept > 10 * CHUNK
    assert sum(b - a + 1 for a, b in asked) == size - kept, "the resume must ask for exactly what is missing"
    assert verify_snapshot(snap_store := Store(root), snap.id) == [] and snap_store.list()


@pytest.mark.root
def test_enospc_on_a_small_tmpfs_fails_cleanly_and_keeps_the_store(tmp_path: Path) -> None:
    model = tmp_path / "too-big"
    make_model(model, layers=2, hidden=256, shards=2)  # ~5 MB on a 3 MB tmpfs
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(mnt)], check=True)
    try:
        small = tmp_path / "small-model"
        make_model(small, layers=1, hidden=32, shards=1)
        no_floor = {"min_free_bytes": 0, "min_free_percent": 0.0}  # this test is about ENOSPC, not the floor
        store = Store(mnt / "root", **no_floor)
        first = Fetcher(store).ensure(granted(f"file://{small}/"))
        with pytest.raises(InsufficientSpaceError, match="needs"):
            Fetcher(store).ensure(granted(f"file://{model}/"))
        assert [i.snapshot.id for i in store.list()] == [first.id]
        assert verify_snapshot(store, first.id) == []
        assert list(store.layout.partial.iterdir()) == []
        assert [p.name for p in store.layout.snapshots.iterdir()] == [first.id]
        # fill the disk behind the store's back: the preallocation must fail before any byte is fetched
        filler = mnt / "filler"
        with open(filler, "wb", buffering=0) as fh:  # unbuffered: closing it has nothing left to flush
            try:
                while True:
                    fh.write(b"\0" * (64 << 10))
            except OSError:
                pass
        store2 = Store(mnt / "root", **no_floor)
        store2.ensure_space = lambda needed, uri: None  # type: ignore[method-assign]  # only the disk refuses now
        with pytest.raises(InsufficientSpaceError, match="disk full"):
            Fetcher(store2).ensure(granted(f"file://{model}/"))
        assert list(store2.layout.partial.iterdir()) == []
        assert [i.snapshot.id for i in store2.list()] == [first.id]
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
