"""Helpers for the store tests: small real models fetched from file:// into a real store."""

from __future__ import annotations

import json
from pathlib import Path

from tests.grants import granted
from tests.sample import make_model
from weightcache.fetch import Fetcher
from weightcache.store import Snapshot, Store
from weightcache.store.records import snapshot_id_for
from weightcache.store.types import FileEntry


def make_models(where: Path, *names: str, hidden: int = 64) -> dict[str, Path]:
    """One small distinct model per name (different seeds, so no blob is shared)."""
    out = {}
    for seed, name in enumerate(names, start=1):
        make_model(where / name, layers=1, hidden=hidden, shards=1, seed=seed)
        out[name] = where / name
    return out


def fetch(store: Store, model: Path) -> Snapshot:
    return Fetcher(store, chunk_size=64 << 10).ensure(granted(f"file://{model}/"))


def rewrite_manifest(store: Store, snap_id: str, edit_files: object) -> str:
    """Replace a manifest's file list with `edit_files(files)` (a list of dicts), renaming it to the id its new
    list hashes to when that is computable, so that only the check under test can refuse it. Returns the id."""
    path = store.layout.manifest(snap_id)
    body = json.loads(path.read_text())
    body["files"] = edit_files(body["files"])  # type: ignore[operator]
    try:
        new_id = snapshot_id_for(FileEntry(**f) for f in body["files"])
    except (TypeError, AttributeError):
        new_id = snap_id
    body["id"] = new_id
    path.chmod(0o644)
    path.unlink()
    store.layout.manifest(new_id).write_text(json.dumps(body))
    return new_id


def canary(tmp_path: Path, name: str = "outside") -> Path:
    """A directory outside the store with a file in it; tests assert both survive untouched."""
    d = tmp_path / name
    d.mkdir()
    (d / "precious").write_bytes(b"do not touch")
    (d / "precious").chmod(0o640)
    d.chmod(0o750)
    return d


def assert_untouched(d: Path) -> None:
    assert (d / "precious").read_bytes() == b"do not touch"
    assert (d / "precious").stat().st_mode & 0o777 == 0o640
    assert d.stat().st_mode & 0o777 == 0o750
    assert sorted(p.name for p in d.iterdir()) == ["precious"]
