"""A full disk is survivable: on a real tmpfs filled to 0 bytes, daemon start (opening the store), `ls`,
`verify`, `gc`, `unpin` and `evict` all work; daemon start, `gc` and `evict` give space back down to the floor,
while read-only commands (`ls`, `verify`) evict nothing. The store keeps a free-space floor (minFreeBytes /
minFreePercent) that a fetch may not cut into."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.command import weightcache
from tests.fixtures_daemon import start_daemon
from tests.fixtures_store import fetch, make_models
from weightcache.errors import InsufficientSpaceError
from weightcache.store import Store
from weightcache.store.store import DEFAULT_MIN_FREE_BYTES, RESERVE_BYTES, disk_free


@pytest.fixture
def tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 160 MiB tmpfs: above the default floor of 64 MiB, so the defaults the CLI uses leave room for models."""
    mnt = tmp_path / "fs"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m", "tmpfs", str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


def fill(fs: Path) -> None:
    """Write a file outside the store until the filesystem refuses a single byte."""
    with open(fs / "filler", "wb", buffering=0) as fh:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    fh.write(b"\0" * size)
            except OSError:
                pass
    assert disk_free(fs)[0] == 0


def cli(root: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return weightcache(*args, "--root", str(root), env={**os.environ, **(env or {})})


def populate(fs: Path, tmp_path: Path, *, pin: str) -> tuple[Path, dict[str, str]]:
    models = make_models(tmp_path / "src", "a", "b", hidden=256)
    root = fs / "root"
    store = Store(root)
    ids = {name: fetch(store, models[name]).id for name in ("a", "b")}
    assert store.layout.reserve.stat().st_size == RESERVE_BYTES
    for name in pin:
        store.pin(ids[name])
    store.close()
    return root, ids


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_every_command_works_on_a_full_disk_with_everything_pinned(tmpfs: Path, tmp_path: Path) -> None:
    root, ids = populate(tmpfs, tmp_path, pin="ab")
    (root / "partial" / "mabandoned.0123.part").write_bytes(b"x" * (256 << 10))
    fill(tmpfs)
    for args in (["ls"], ["ls", "-o", "json"], ["verify"]):
        proc = cli(root, *args)
        assert proc.returncode == 0, proc.stderr
    assert ids["a"][:12] in cli(root, "ls").stdout
    proc = cli(root, "gc")
    assert proc.returncode == 0 and "freed" in proc.stdout, proc.stderr
    assert not (root / "partial" / "mabandoned.0123.part").exists()
    assert cli(root, "unpin", ids["a"]).returncode == 0
    proc = cli(root, "ls")  # below the floor, but a read-only command evicts nothing
    assert proc.returncode == 0 and ids["a"][:12] in proc.stdout, proc.stderr
    before = disk_free(tmpfs)[0]
    proc = cli(root, "gc")  # gives space back down to the floor: a, no longer pinned, goes
    assert proc.returncode == 0, proc.stderr
    assert disk_free(tmpfs)[0] > before + (256 << 10)
    store = Store(root, evict_to_floor=False)
    assert [i.snapshot.id for i in store.list()] == [ids["b"]]
    assert list(store.layout.evicting.iterdir()) == []


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_store_start_on_a_full_disk_gives_space_back_down_to_the_floor(tmpfs: Path, tmp_path: Path) -> None:
    root, ids = populate(tmpfs, tmp_path, pin="b")
    fill(tmpfs)
    proc = cli(root, "ls")  # 0 bytes free and a evictable: a read-only command still works and keeps it
    assert proc.returncode == 0 and ids["a"][:12] in proc.stdout, proc.stderr
    store = Store(root)  # what daemon start does first (the CLI's read-only commands pass evict_to_floor=False)
    assert [i.snapshot.id for i in store.list()] == [ids["b"]]  # a (unpinned) evicted; b (pinned) kept
    assert disk_free(tmpfs)[0] > 0
    assert list(store.layout.evicting.iterdir()) == [] and not (root / "snapshots" / ids["a"]).exists()


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_eviction_on_a_full_disk_finishes_even_when_its_blobs_are_shared(tmpfs: Path, tmp_path: Path) -> None:
    """Evicting frees no data here (every blob is shared with the kept snapshot): only the reserve makes room."""
    models = make_models(tmp_path / "src", "a")
    models["a2"] = tmp_path / "src" / "a2"
    models["a2"].mkdir()
    for p in models["a"].iterdir():
        (models["a2"] / p.name).write_bytes(p.read_bytes())
    (models["a2"] / "extra.txt").write_bytes(b"")  # the empty file's blob is new but takes no space
    store = Store(tmpfs / "root")
    a, a2 = fetch(store, models["a"]), fetch(store, models["a2"])
    store.pin(a2.id)
    fill(tmpfs)
    store.evict(a.id)
    assert [i.snapshot.id for i in store.list()] == [a2.id]
    assert not store.layout.eviction(a.id).exists()


@pytest.mark.e2e
def test_ls_below_the_floor_evicts_nothing_and_evict_gives_space_back(tmp_path: Path) -> None:
    """A disk below the floor but not full (a laptop at 90%): `ls` and `verify` leave every model cached;
    `evict` of one model also gives space back, least recently used first, keeping what is pinned."""
    models = make_models(tmp_path / "src", "a", "b", "c")
    root = tmp_path / "root"
    store = Store(root, min_free_bytes=0, min_free_percent=0)
    ids = {name: fetch(store, models[name]).id for name in ("a", "b", "c")}
    store.pin(ids["c"])
    store.close()
    below = {"WEIGHTCACHE_MIN_FREE_BYTES": str(disk_free(tmp_path)[0] + (1 << 40))}
    for args in (["ls"], ["verify"], ["status"]):
        proc = cli(root, *args, env=below)
        assert proc.returncode == 0, proc.stderr
    listed = cli(root, "ls", env=below).stdout
    assert all(snap_id[:12] in listed for snap_id in ids.values()), listed
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == sorted(ids.values())
    proc = cli(root, "evict", ids["a"], env=below)
    assert proc.returncode == 0, proc.stderr
    left = Store(root, evict_to_floor=False)
    assert [i.snapshot.id for i in left.list()] == [ids["c"]]  # a asked for, b for the floor, c pinned
    assert sorted(p.name for p in (root / "snapshots").iterdir()) == [ids["c"]]


def test_a_fetch_may_not_cut_into_the_free_space_floor(tmp_path: Path) -> None:
    models = make_models(tmp_path / "src", "a")
    free, _ = disk_free(tmp_path)
    store = Store(tmp_path / "root", min_free_bytes=free + (1 << 30), min_free_percent=0)  # the disk is below it
    with pytest.raises(InsufficientSpaceError, match=r"keeps .* free"):
        fetch(store, models["a"])
    assert list(store.layout.partial.iterdir()) == [] and store.list() == []
    roomy = Store(tmp_path / "root", min_free_bytes=0, min_free_percent=0)
    assert fetch(roomy, models["a"]).size > 0


def test_default_floor_stays_above_kubelets_eviction_threshold(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    assert store.floor_bytes(1 << 40) > (1 << 40) // 10  # nodefs.available<10%
    assert store.floor_bytes(100 << 20) == DEFAULT_MIN_FREE_BYTES  # small disks: room for index and journals


def test_floor_is_configured_by_the_daemon_config(tmp_path: Path) -> None:
    from weightcache.daemon.config import load_settings, parse_settings
    from weightcache.errors import ConfigError

    s = parse_settings({"minFreeBytes": "2Gi", "minFreePercent": 5})
    assert (s.store.min_free_bytes, s.store.min_free_percent) == (2 << 30, 5.0)
    env = load_settings(None, env={"WEIGHTCACHE_MIN_FREE_BYTES": "1Gi", "WEIGHTCACHE_MIN_FREE_PERCENT": "0"})
    assert (env.store.min_free_bytes, env.store.min_free_percent) == (1 << 30, 0.0)
    for bad in ({"minFreePercent": 95}, {"minFreePercent": "lots"}, {"minFreeBytes": "-1"}):
        with pytest.raises(ConfigError, match="minFree"):
            parse_settings(bad)
    store = Store(tmp_path / "root", min_free_bytes=s.store.min_free_bytes, min_free_percent=s.store.min_free_percent)
    assert store.floor_bytes(100 << 30) == 5 << 30 and store.floor_bytes(10 << 30) == 2 << 30


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
async def test_daemon_starts_on_a_full_disk_answers_and_gives_space_back(tmpfs: Path, tmp_path: Path) -> None:
    import asyncio
    import tempfile

    _, ids = await asyncio.to_thread(populate, tmpfs, tmp_path, pin="b")
    await asyncio.to_thread(fill, tmpfs)
    sock_dir = Path(tempfile.mkdtemp(prefix="wcs-"))  # a Unix socket path must stay under 108 bytes
    running = await start_daemon(tmpfs, tmp_path / "src" / "a", socket=sock_dir / "d.sock")
    try:
        listed = await asyncio.to_thread(running.client.list)
        assert [m["id"] for m in listed] == [ids["b"]]  # a (unpinned) gave its space back at start
        assert (await asyncio.to_thread(running.client.verify, ids["b"]))["damaged"] == []
        assert disk_free(tmpfs)[0] > 0
    finally:
        await running.daemon.stop()
        shutil.rmtree(sock_dir, ignore_errors=True)


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_an_eviction_cut_short_is_finished_before_the_index_is_opened(tmpfs: Path, tmp_path: Path) -> None:
    """Crash after the eviction's commit, no reserve left, disk at 0 bytes: only finishing the eviction's file
    deletes before opening the index (which needs new bytes for its WAL) lets the store open at all."""
    root, ids = populate(tmpfs, tmp_path, pin="b")
    code = ("import os, sys; from weightcache.store.store import Store; "
            "setattr(Store, 'finish_eviction', lambda *a, **k: os._exit(137)); Store(sys.argv[1]).evict(sys.argv[2])")
    proc = subprocess.run([sys.executable, "-c", code, str(root), ids["a"]], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 137, proc.stderr
    for name in ("reserve", "index.db-wal", "index.db-shm"):  # the index is derived: losing its WAL loses nothing
        (root / name).unlink(missing_ok=True)
    fill(tmpfs)
    store = Store(root, min_free_bytes=0, min_free_percent=0)  # no floor: only the eviction may free anything
    assert [i.snapshot.id for i in store.list()] == [ids["b"]]
    assert list(store.layout.evicting.iterdir()) == [] and disk_free(tmpfs)[0] > 0


@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_full_disk_is_never_taken_for_a_damaged_index(tmpfs: Path, tmp_path: Path) -> None:
    """Nothing to free and no reserve left: opening fails with the fix to make, and the index is kept as it is."""
    root, ids = populate(tmpfs, tmp_path, pin="ab")
    (root / "reserve").unlink()
    fill(tmpfs)
    with pytest.raises(InsufficientSpaceError, match=r"disk .* is full"):
        Store(root)
    assert not list((root / "quarantine").iterdir())
    (tmpfs / "filler").unlink()
    assert sorted(i.snapshot.id for i in Store(root).list()) == sorted(ids.values())


def _leave_free(fs: Path, free: int) -> None:
    """Fill the filesystem from outside the store until `free` bytes are left."""
    with open(fs / "filler", "wb") as fh:
        os.posix_fallocate(fh.fileno(), 0, disk_free(fs)[0] - free)


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_gc_keeps_the_floor_the_store_was_given_and_says_what_it_removed(tmpfs: Path, tmp_path: Path) -> None:
    """Hardening IV: the floor was a per-command default: a model fetched with `--min-free-bytes 0` on a small
    disk was evicted by the next plain `gc`, which said `freed 0 B`. The floor a command sets is now kept with the
    store (limits.json) and every later command keeps it; gc tells evictions apart from garbage."""
    model = make_models(tmp_path / "src", "a", hidden=256)["a"]
    root = tmpfs / "root"
    _leave_free(tmpfs, 40 << 20)  # under the default floor of 64 MiB (11 % of 160 MiB: 17.6 MiB)
    proc = weightcache("prefetch", f"file://{model}/", "--root", str(root), "--min-free-bytes", "0",
                       "--min-free-percent", "0", "-q")
    assert proc.returncode == 0, proc.stderr
    (snap_id,) = [p.name for p in (root / "snapshots").iterdir()]
    (root / "partial" / "mabandoned.0123.part").write_bytes(b"x" * (256 << 10))

    plain = cli(root, "gc", "-o", "json")  # given no floor: the store's own (0), not the default's 64 MiB
    assert plain.returncode == 0, plain.stderr
    report = json.loads(plain.stdout)
    assert report["evicted"] == [] and report["evicted_bytes"] == 0
    assert report["partial_bytes"] == 256 << 10 and report["freed_bytes"] == 256 << 10
    assert [p.name for p in (root / "snapshots").iterdir()] == [snap_id]
    assert cli(root, "evict", "--to-size", "1Ti").returncode == 0  # nor does evict, nor a store's recovery
    assert [i.snapshot.id for i in Store(root).list()] == [snap_id]

    raised = cli(root, "gc", "--min-free-bytes", "100Mi")  # a floor given now is kept, and gc says why it evicts
    assert raised.returncode == 0, raised.stderr
    assert f"evicted 1 snapshot(s) ({snap_id[:12]}; " in raised.stdout, raised.stdout
    assert "because the disk had less free than the store's floor of 100 MiB" in raised.stdout
    assert "0 B of abandoned partial downloads" in raised.stdout
    assert json.loads((root / "limits.json").read_text())["min_free_bytes"] == 100 << 20
    assert Store(root, evict_to_floor=False).min_free_bytes == 100 << 20


@pytest.mark.e2e
@pytest.mark.root
@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_disk_another_writer_filled_gets_advice_that_works(tmpfs: Path, tmp_path: Path) -> None:
    """Hardening IV: when another writer filled the disk (and the store's reserve was spent), the error said to
    free space with `weightcache evict` / `gc`, which fail the same way (they write the index too). It now says
    how much is the store's and how much other files', to free those first, and how to find them; doing so works."""
    models = make_models(tmp_path / "src", "a", "b", hidden=256)
    root = tmpfs / "root"
    store = Store(root, min_free_bytes=0, min_free_percent=0)
    fetch(store, models["a"])
    store.close()
    (root / "reserve").unlink()  # spent earlier: the disk never had room to make it again
    fill(tmpfs)
    for args in (["prefetch", f"file://{models['b']}/"], ["gc"], ["evict", "--to-size", "0"]):
        proc = cli(root, *args)
        assert proc.returncode == 5, proc.stderr
        assert "weightcache evict and gc record what they remove in the store's index too, so they fail the same " \
               "way until a few MiB are free: first free space outside the store" in proc.stderr, proc.stderr
        assert f"`du -xh --max-depth=2 {tmpfs} | sort -h | tail`" in proc.stderr
        assert "of its 160 MiB and other files 15" in proc.stderr  # the filler: about 159 MiB of it
    (tmpfs / "filler").unlink()  # the advice, followed
    assert cli(root, "evict", "--to-size", "0").returncode == 0
    assert cli(root, "prefetch", f"file://{models['b']}/", "-q").returncode == 0
