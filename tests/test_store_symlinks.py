"""No store operation follows a symlink it did not create.

Each case plants one symlink inside the store root pointing at a directory or file outside it, then runs
startup recovery, a fetch, lease/release, pin/unpin, verify, gc and eviction. The outside target must be left
exactly as it was: not deleted, not chmod-ed, not written, and no file created in it.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures_store import assert_untouched, canary, fetch, make_models
from weightcache.store import Store, collect_garbage, verify_snapshot
from weightcache.uri import parse_ref


class Planted:
    """What a case needs: the store root, the outside canary, the models, and the first snapshot's id."""

    def __init__(self, root: Path, outside: Path, models: dict[str, Path], first_id: str) -> None:
        self.root, self.outside, self.models, self.first_id = root, outside, models, first_id

    def replace_dir(self, rel: str, target: Path) -> Path:
        """Move the real directory away (out of the store) and put a symlink to `target` in its place."""
        path = self.root / rel
        if path.exists():
            shutil.move(str(path), str(self.root.parent / f"moved-{rel.replace('/', '-')}"))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.symlink_to(target)
        return path

    def part_names(self, model: str) -> list[Path]:
        """The names the fetch engine gives its partial files for `model` (checked: each link must be gone after)."""
        key = parse_ref(f"file://{self.models[model]}/").key
        return [self.root / "partial" / f"{key}.{hashlib.sha256(p.name.encode()).hexdigest()[:16]}.part"
                for p in sorted(self.models[model].iterdir())]


def _blob_prefix(p: Planted) -> Path:
    first = sorted(p.models["b"].iterdir())[0]
    prefix = hashlib.sha256(first.read_bytes()).hexdigest()[:2]
    return p.replace_dir(f"blobs/sha256/{prefix}", p.outside)


def _part_files(p: Planted) -> list[Path]:
    links = p.part_names("b")
    for link in links:
        link.symlink_to(p.outside / "precious")
    return links


def _journals(p: Planted) -> list[Path]:
    links = [part.with_suffix(".journal") for part in p.part_names("b")]
    for link in links:
        link.symlink_to(p.outside / "precious")
    return links


def _index(p: Planted) -> Path:
    for suffix in ("", "-wal", "-shm"):
        (p.root / f"index.db{suffix}").unlink(missing_ok=True)
    (p.root / "index.db").symlink_to(p.outside / "precious")
    return p.root / "index.db"  # rebuilt in its place: a regular file now


def _file_link(rel: str) -> Callable[[Planted], Path]:
    def plant(p: Planted) -> Path:
        path = p.root / rel.format(first=p.first_id, key=parse_ref(f"file://{p.models['a']}/").key)
        path.unlink(missing_ok=True)
        path.symlink_to(p.outside / "precious")
        return path
    return plant


CASES: dict[str, Callable[[Planted], object]] = {
    "partial/": lambda p: p.replace_dir("partial", p.outside),
    "snapshots/": lambda p: p.replace_dir("snapshots", p.outside),
    "snapshots/<id>": lambda p: p.replace_dir("snapshots/" + "f" * 40, p.outside),
    "blobs/": lambda p: p.replace_dir("blobs", p.outside),
    "blobs/sha256/<ab>": _blob_prefix,
    "refs/": lambda p: p.replace_dir("refs", p.outside),
    "refs/<key>": lambda p: p.replace_dir("refs/" + parse_ref(f"file://{p.models['b']}/").key, p.outside),
    "leases/": lambda p: p.replace_dir("leases", p.outside),
    "pins/": lambda p: p.replace_dir("pins", p.outside),
    "pins/<id>": lambda p: p.replace_dir(f"pins/{p.first_id}", p.outside),
    "evicting/": lambda p: p.replace_dir("evicting", p.outside),
    "quarantine/": lambda p: p.replace_dir("quarantine", p.outside),
    "locks/": lambda p: p.replace_dir("locks", p.outside),
    "locks/store.lock": _file_link("locks/store.lock"),
    "manifests/<id>.json": _file_link("manifests/" + "e" * 40 + ".json"),
    "leases/<holder>": _file_link("leases/csi%3Avol-1"),
    "refs/<key>/latest": _file_link("refs/{key}/latest"),
    "partial/*.part": _part_files,
    "partial/*.journal": _journals,
    "index.db": _index,
}


@pytest.mark.parametrize("case", list(CASES))
def test_planted_symlink_is_never_followed(tmp_path: Path, case: str) -> None:
    outside = canary(tmp_path)
    models = make_models(tmp_path / "src", "a", "b")
    root = tmp_path / "store" / "root"
    store = Store(root)
    first = fetch(store, models["a"])
    store.close()
    planted = CASES[case](Planted(root, outside, models, first.id))

    store = Store(root)  # startup recovery
    assert_untouched(outside)
    second = fetch(store, models["b"])
    assert_untouched(outside)  # checked after each step: a later step could hide what an earlier one did
    assert verify_snapshot(store, second.id) == []
    for snap_id in (first.id, second.id):
        store.lease("csi:vol-1", snap_id)
        assert_untouched(outside)
        store.release("csi:vol-1")
        store.pin(snap_id)
        assert_untouched(outside)
        store.unpin(snap_id)
    for info in store.list():
        verify_snapshot(store, info.snapshot.id)
    collect_garbage(store)
    assert_untouched(outside)
    store.evict_to(0)
    assert store.list() == []
    assert_untouched(outside)
    if isinstance(planted, list):  # file links the fetch engine met: dropped, not followed
        assert not any(os.path.lexists(p) for p in planted)


def test_symlink_inside_a_snapshot_counts_as_damage_not_as_content(tmp_path: Path) -> None:
    outside = canary(tmp_path)
    models = make_models(tmp_path / "src", "a")
    store = Store(tmp_path / "root")
    snap = fetch(store, models["a"])
    victim = snap.path / snap.files[0].path
    snap.path.chmod(0o755)
    victim.unlink()
    victim.symlink_to(outside / "precious")
    assert verify_snapshot(store, snap.id) == [snap.files[0].path]
    store.evict(snap.id)
    assert_untouched(outside)


def test_a_manifest_symlinked_to_a_valid_manifest_outside_is_not_adopted(tmp_path: Path) -> None:
    models = make_models(tmp_path / "src", "a")
    store = Store(tmp_path / "root")
    a = fetch(store, models["a"])
    store.close()
    copy = tmp_path / "outside-manifest.json"
    copy.write_bytes(store.layout.manifest(a.id).read_bytes())
    store.layout.manifest(a.id).unlink()
    store.layout.manifest(a.id).symlink_to(copy)  # a valid manifest, but not one the store wrote in its tree
    again = Store(tmp_path / "root")
    assert again.list() == [] and not a.path.exists()
    assert copy.read_bytes() and not store.layout.manifest(a.id).exists()


def test_an_index_symlinked_to_another_database_leaves_that_database_alone(tmp_path: Path) -> None:
    import sqlite3

    other = tmp_path / "someone-elses.db"
    db = sqlite3.connect(other)
    db.execute("CREATE TABLE t (x)")
    db.execute("INSERT INTO t VALUES (1)")
    db.commit()
    db.close()
    before = other.read_bytes()
    root = tmp_path / "root"
    Store(root).close()
    for suffix in ("", "-wal", "-shm"):
        Path(f"{root}/index.db{suffix}").unlink(missing_ok=True)
    (root / "index.db").symlink_to(other)
    Store(root).list()
    assert other.read_bytes() == before and not Path(f"{other}-wal").exists()
