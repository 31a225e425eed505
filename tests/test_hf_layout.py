"""A published snapshot presented as a hub cache for one repo: real transformers and huggingface_hub load
`org/name` from it offline, its files are the snapshot's own inodes (no copy), and a read-only bind mount of it
works the same (root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_hf import HubLoader, tiny_llama
from tests.grants import granted
from weightcache.errors import InvalidReferenceError, InvalidRequestError
from weightcache.fetch import Fetcher
from weightcache.hf_layout import (
    HF_DIR,
    MAX_VIEWS_PER_SNAPSHOT,
    commit_of,
    hub_cache,
    prune,
    repo_folder,
)
from weightcache.store import Snapshot, Store
from weightcache.uri import validate_repo_id

REPO = "acme/tiny-llama"
@pytest.fixture(scope="module")
def published(tmp_path_factory: pytest.TempPathFactory) -> tuple[Store, Snapshot, list[int]]:
    base = tmp_path_factory.mktemp("hf")
    reference = tiny_llama(tmp_path_factory, base / "src" / "tiny-llama")
    store = Store(base / "root")
    snapshot = Fetcher(store).ensure(granted(f"file://{base / 'src' / 'tiny-llama'}/"))
    return store, snapshot, reference


def test_transformers_and_hub_load_the_repo_offline_from_the_layout(
        published: tuple[Store, Snapshot, list[int]], hub_loader: HubLoader) -> None:
    store, snapshot, reference = published
    cache = hub_cache(store, snapshot, REPO)
    result = hub_loader.load(cache, REPO)
    assert result["tokens"] == reference
    commit = commit_of(snapshot)
    assert result["path"] == str(cache / repo_folder(REPO) / "snapshots" / commit)
    assert (cache / repo_folder(REPO) / "refs" / "main").read_text() == commit


def test_layout_files_are_the_snapshots_inodes_and_read_only(
        published: tuple[Store, Snapshot, list[int]]) -> None:
    store, snapshot, _ = published
    cache = hub_cache(store, snapshot, REPO)
    files = cache / "models--acme--tiny-llama" / "snapshots" / commit_of(snapshot)
    assert sorted(p.name for p in files.iterdir()) == sorted(e.path for e in snapshot.files)
    for entry in snapshot.files:
        ours, theirs = files / entry.path, snapshot.path / entry.path
        assert not ours.is_symlink() and ours.stat().st_ino == theirs.stat().st_ino  # a hard link: no bytes copied
    for directory, _, _ in os.walk(cache):
        assert os.stat(directory).st_mode & 0o222 == 0, directory
    assert hub_cache(store, snapshot, REPO) == cache  # built once, then reused
    assert not [p for p in cache.parent.iterdir() if p.name.startswith(".tmp-")]


def small_snapshots(store: Store, tmp_path: Path, *names: str) -> list[Snapshot]:
    snaps = []
    for name in names:
        src = tmp_path / "src" / name
        src.mkdir(parents=True)
        (src / "config.json").write_text(json.dumps({"name": name}))
        (src / "sub").mkdir()
        (src / "sub" / "w.bin").write_bytes(name.encode() * 10)
        snaps.append(Fetcher(store).ensure(granted(f"file://{src}/")))
    return snaps


def test_eviction_removes_the_views_so_their_links_keep_no_evicted_bytes(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    snaps = small_snapshots(store, tmp_path, "a", "b")
    for snap in snaps:
        store.lease(f"pod-{snap.id}", snap.id)
    first = hub_cache(store, snaps[0], "acme/a")
    second = hub_cache(store, snaps[1], "acme/b")
    blob = store.layout.blob(snaps[0].files[0].sha256)
    assert blob.stat().st_nlink == 3  # blob, snapshot, hub cache view: one inode, no copy
    store.release(f"pod-{snaps[0].id}")
    store.evict(snaps[0].id)
    assert not first.exists() and not first.parent.exists() and second.exists()
    assert not blob.exists(), "the view's hard links kept the evicted bytes on disk"
    assert prune(store) == 0  # what the daemon's reconcile pass runs: nothing left to do


def test_views_of_a_snapshot_nothing_holds_are_removed_and_rebuilt_on_the_next_mount(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    held, idle = small_snapshots(store, tmp_path, "a", "b")
    store.lease("pod-1", held.id)
    store.lease("pod-2", idle.id)
    kept, dropped = hub_cache(store, held, "acme/a"), hub_cache(store, idle, "acme/b")
    assert prune(store) == 0  # both still leased
    store.release("pod-2")
    assert prune(store) == 1
    assert kept.exists() and not dropped.parent.exists()
    store.lease("pod-3", idle.id)
    assert (hub_cache(store, idle, "acme/b") / "models--acme--b" / "snapshots").is_dir()
    store.release("pod-3")
    assert prune(store) == 1 and not dropped.parent.exists()


def test_repo_names_per_snapshot_are_capped_and_the_next_costs_only_its_pod(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    (snap,) = small_snapshots(store, tmp_path, "a")
    store.lease("pod", snap.id)
    views = [hub_cache(store, snap, f"acme/name-{i}") for i in range(MAX_VIEWS_PER_SNAPSHOT)]
    with pytest.raises(InvalidRequestError, match=r"volume_context\.hfRepo: 'evil/one-more' would be the 9th"):
        hub_cache(store, snap, "evil/one-more")
    assert hub_cache(store, snap, "acme/name-0") == views[0]  # the names already shown still mount
    assert not [n for n in os.listdir(views[0].parent) if "one-more" in n]  # no half-built tree left


def test_a_symlink_planted_in_the_view_path_is_not_followed(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    (snap,) = small_snapshots(store, tmp_path, "a")
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.root / HF_DIR).mkdir()
    (store.root / HF_DIR / snap.id).symlink_to(outside)
    view = hub_cache(store, snap, "acme/a")
    assert os.listdir(outside) == []
    snapshots = view / "models--acme--a" / "snapshots"
    assert not view.parent.is_symlink() and snapshots.is_dir()
    assert (next(snapshots.iterdir()) / "sub" / "w.bin").read_bytes() == b"a" * 10


def test_the_webhook_checks_hf_repo_names_without_importing_the_store() -> None:
    code = ("import sys, weightcache.webhook.mutate; "
            "print(sorted(m for m in ('sqlite3', 'weightcache.store', 'weightcache.hf_layout') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_a_source_commit_names_the_snapshot(published: tuple[Store, Snapshot, list[int]]) -> None:
    _, snapshot, _ = published
    commit = "0123456789abcdef0123456789abcdef01234567"
    assert commit_of(Snapshot(snapshot.id, snapshot.path, snapshot.uri, commit, snapshot.size)) == commit
    derived = commit_of(Snapshot(snapshot.id, snapshot.path, snapshot.uri, "main", snapshot.size))
    assert len(derived) == 40 and derived == commit_of(Snapshot(snapshot.id, snapshot.path, snapshot.uri, None, 0))
    assert derived != commit_of(Snapshot(snapshot.id + "x", snapshot.path, snapshot.uri, None, 0))


@pytest.mark.parametrize("bad", ["", "a/b/c", "../x", "org/..", "org--x/y", "-org/x", "org/x-", "a b/c",
                                 "o/" + "x" * 97, "org/na\x00me", "/abs", "org/name\n"])
def test_bad_repo_ids_are_refused(bad: str) -> None:
    with pytest.raises(InvalidReferenceError, match="not a Hugging Face repo id"):
        validate_repo_id(bad)


@pytest.mark.parametrize("good", ["gpt2", "meta-llama/Llama-3.1-8B", "Qwen/Qwen2.5-0.5B-Instruct", "a/b_c.d"])
def test_real_repo_ids_are_accepted(good: str) -> None:
    assert validate_repo_id(good) == good


@pytest.mark.root
def test_a_read_only_bind_mount_of_the_layout_loads(published: tuple[Store, Snapshot, list[int]],
                                                    hub_loader: HubLoader, tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("needs root and mount(8)")
    store, snapshot, reference = published
    cache = hub_cache(store, snapshot, REPO)
    target = tmp_path / "mnt"
    target.mkdir()
    subprocess.run(["mount", "--bind", str(cache), str(target)], check=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(target)], check=True)
        assert hub_loader.load(target, REPO)["tokens"] == reference
    finally:
        subprocess.run(["umount", str(target)], check=True)
