"""The tree is data, not code: every manifest, ref, lease, pin and index read back is checked; a bad one is
quarantined with a log line naming it, never followed, and never stops startup, `ls` or eviction."""

from __future__ import annotations

import contextlib
import json
import logging
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_store import assert_untouched, canary, fetch, make_models, rewrite_manifest
from weightcache.errors import DamagedRecordError
from weightcache.store import Store
from weightcache.store.records import Manifest, manifest_bytes, parse_lease, parse_manifest, parse_ref, snapshot_id_for
from weightcache.store.types import FileEntry
from weightcache.uri import parse_ref as parse_model_ref

SHA = "ab" * 32
Files = list[dict[str, Any]]


def good_manifest() -> dict[str, Any]:
    files = (FileEntry("config.json", 10, SHA), FileEntry("w/model.safetensors", 2048, "cd" * 32, "etag-1"))
    return json.loads(manifest_bytes(Manifest(snapshot_id_for(files), "s3://b/m/", None, 1.5, files)))


def encode(body: dict[str, Any], *, rehash: bool = True) -> tuple[bytes, str]:
    """The manifest bytes and the id its files hash to (when they can), so only the check under test refuses it."""
    if rehash:
        with contextlib.suppress(TypeError, AttributeError):
            body["id"] = snapshot_id_for(FileEntry(**f) for f in body["files"])
    return json.dumps(body).encode(), body["id"]


def test_a_good_manifest_reads_back() -> None:
    data, snap_id = encode(good_manifest())
    m = parse_manifest(data, snap_id)
    assert [f.path for f in m.files] == ["config.json", "w/model.safetensors"] and m.files[1].etag == "etag-1"


def _set(i: int, key: str, value: object) -> Callable[[Files], Files]:
    def edit(files: Files) -> Files:
        files[i][key] = value
        return files
    return edit


BAD_FILES: dict[str, tuple[Callable[[Files], Files], str]] = {
    "digest escapes": (_set(0, "sha256", "../../../../outside/precious"), "sha256"),
    "digest too short": (_set(0, "sha256", "ab" * 31), "sha256"),
    "digest upper case": (_set(0, "sha256", "AB" * 32), "sha256"),
    "digest not a string": (_set(0, "sha256", 12), "sha256"),
    "size a string": (_set(0, "size", "10"), "size"),
    "size negative": (_set(0, "size", -1), "size"),
    "size past int64": (_set(0, "size", 1 << 63), "size"),
    "size a bool": (_set(0, "size", True), "size"),
    "size a float": (_set(0, "size", 1.5), "size"),
    "path dot-dot": (_set(0, "path", "../x"), "'..'"),
    "path absolute": (_set(0, "path", "/etc/passwd"), "absolute"),
    "path not normalised": (_set(0, "path", "a//b"), "segment"),
    "path with NUL": (_set(0, "path", "a\0b"), "NUL"),
    "path not a string": (_set(0, "path", ["a"]), "path"),
    "path twice": (lambda fs: [fs[0], dict(fs[0])], "twice"),
    "file and directory": (_set(0, "path", "w"), "both a file and a directory"),
    "etag not a string": (_set(0, "etag", {"x": 1}), "etag"),
    "unknown key": (_set(0, "mode", 0o777), "file entry"),
    "entry not an object": (lambda fs: [*fs, "x"], "file entry"),
    "files not a list": (lambda fs: {"a": fs}, "files"),  # type: ignore[dict-item, return-value]
}


@pytest.mark.parametrize("case", sorted(BAD_FILES))
def test_each_file_entry_check_refuses_its_case(case: str) -> None:
    edit, words = BAD_FILES[case]
    body = good_manifest()
    body["files"] = edit(body["files"])
    data, snap_id = encode(body)
    with pytest.raises(DamagedRecordError, match=words):
        parse_manifest(data, snap_id)


@pytest.mark.parametrize(("key", "value", "words"), [
    ("version", 2, "version"), ("id", "0" * 40, "does not match"), ("created", "yesterday", "created"),
    ("created", float("inf"), "created"), ("uri", None, "uri"), ("revision", 5, "revision"),
])
def test_manifest_header_checks(key: str, value: object, words: str) -> None:
    body = good_manifest()
    file_name_id = body["id"]
    body[key] = value
    with pytest.raises(DamagedRecordError, match=words):
        parse_manifest(json.dumps(body).encode(), file_name_id)


def test_manifest_whose_files_do_not_hash_to_its_id_is_refused() -> None:
    body = good_manifest()
    body["files"][0]["size"] = 11  # edited after publish
    with pytest.raises(DamagedRecordError, match="do not hash"):
        parse_manifest(json.dumps(body).encode(), body["id"])


@pytest.mark.parametrize("data", [b"", b"\xff\xfe", b"[1]", b"null", b"{" * 5000, b'{"version": 1}'])
def test_garbage_is_a_damaged_record(data: bytes) -> None:
    with pytest.raises(DamagedRecordError):
        parse_manifest(data, "0" * 40)


def test_refs_and_leases_are_checked() -> None:
    good = {"snapshot": "a" * 40, "uri": "s3://b/m/", "revision": None}
    assert parse_ref(json.dumps(good).encode()).snapshot == "a" * 40
    for bad in ({"snapshot": "../../x", "uri": "u"}, {"snapshot": "a" * 40}, {"snapshot": "a" * 40, "uri": 3}, []):
        with pytest.raises(DamagedRecordError):
            parse_ref(json.dumps(bad).encode())
    assert parse_lease(b"a" * 40 + b"\n") == "a" * 40
    for bad_lease in (b"../../etc\n", b"", b"A" * 40, b"a" * 41):
        with pytest.raises(DamagedRecordError):
            parse_lease(bad_lease)


def test_layout_refuses_a_digest_or_name_that_leaves_its_directory(tmp_path: Path) -> None:
    store = Store(tmp_path / "root")
    with pytest.raises(DamagedRecordError):
        store.layout.blob("../../../../etc/passwd")
    for name in ("..", "a/b", ""):
        with pytest.raises(DamagedRecordError):
            store.layout.snapshot(name)
    with pytest.raises(DamagedRecordError):
        store.layout.lease("..")


# -- on a real store ------------------------------------------------------------------------------------------
def test_escaping_digest_is_quarantined_and_evict_deletes_nothing_outside(tmp_path: Path,
                                                                         caplog: pytest.LogCaptureFixture) -> None:
    outside = canary(tmp_path)
    models = make_models(tmp_path / "src", "a", "b")
    store = Store(tmp_path / "root")
    a, b = fetch(store, models["a"]), fetch(store, models["b"])
    store.close()
    depth = len(store.layout.blob(SHA).relative_to(tmp_path).parts) - 1
    escape = "/".join([".."] * depth) + "/outside/precious"
    bad_id = rewrite_manifest(store, a.id, _set(0, "sha256", escape))
    with caplog.at_level(logging.WARNING):
        again = Store(tmp_path / "root")
    assert [i.snapshot.id for i in again.list()] == [b.id]
    assert f"manifests/{bad_id}.json" in caplog.text and "quarantine" in caplog.text
    assert list((tmp_path / "root" / "quarantine").glob(f"manifests%2F{bad_id}.json.*"))
    again.evict_to(0)
    assert again.list() == []
    assert_untouched(outside)


@pytest.mark.parametrize("edit", [_set(0, "size", "12"), _set(0, "size", -5), _set(0, "path", 7),
                                  lambda fs: "not a list"], ids=["size-str", "size-neg", "path-int", "files-str"])
def test_bad_manifest_does_not_stop_startup_ls_or_evict(tmp_path: Path, edit: Callable[[Files], Files]) -> None:
    models = make_models(tmp_path / "src", "a", "b")
    store = Store(tmp_path / "root")
    a, b = fetch(store, models["a"]), fetch(store, models["b"])
    store.close()
    rewrite_manifest(store, a.id, edit)
    again = Store(tmp_path / "root")
    assert [i.snapshot.id for i in again.list()] == [b.id]
    assert not a.path.exists()
    assert again.evict_to(0) == [b.id]


def test_bad_ref_lease_and_pin_are_quarantined(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    models = make_models(tmp_path / "src", "a")
    store = Store(tmp_path / "root")
    a = fetch(store, models["a"])
    ref = parse_model_ref(f"file://{models['a']}/")
    store.layout.ref(ref.key, "latest").write_text(json.dumps({"snapshot": "../../../outside", "uri": ref.uri}))
    store.layout.lease("csi:vol-1").write_text("../../etc/passwd\n")
    (store.layout.pins / "not-a-snapshot").mkdir()
    store.close()
    with caplog.at_level(logging.WARNING):
        again = Store(tmp_path / "root")
    assert again.lookup(ref) is None  # the ref is gone; the snapshot is still there, by id
    assert again.get(a.id).id == a.id and again.leases() == {}
    names = sorted(p.name.split(".")[0] for p in (tmp_path / "root" / "quarantine").iterdir())
    assert names == sorted([f"refs%2F{ref.key}%2Flatest", "leases%2Fcsi%3Avol-1", "pins%2Fnot-a-snapshot"])
    assert caplog.text.count("quarantine") >= 3
    assert fetch(again, models["a"]).id == a.id  # fetching again writes a good ref
    assert again.lookup(ref) is not None


def test_foreign_index_is_moved_aside_and_rebuilt(tmp_path: Path) -> None:
    models = make_models(tmp_path / "src", "a")
    store = Store(tmp_path / "root")
    a = fetch(store, models["a"])
    store.close()
    store.layout.index.unlink()
    db = sqlite3.connect(store.layout.index)
    db.executescript("CREATE TABLE snapshots (id TEXT, owner TEXT); INSERT INTO snapshots VALUES ('x', 'y');"
                     "CREATE TABLE files (a); CREATE TABLE refs (b);")
    db.close()
    again = Store(tmp_path / "root")
    assert [i.snapshot.id for i in again.list()] == [a.id]
    assert list((tmp_path / "root" / "quarantine").glob("index.db.*"))


def test_index_of_a_newer_schema_is_rebuilt_not_used(tmp_path: Path) -> None:
    models = make_models(tmp_path / "src", "a")
    store = Store(tmp_path / "root")
    a = fetch(store, models["a"])
    store.close()
    db = sqlite3.connect(store.layout.index)
    db.execute("PRAGMA user_version=99")
    db.close()
    again = Store(tmp_path / "root")
    assert [i.snapshot.id for i in again.list()] == [a.id]
    assert sqlite3.connect(store.layout.index).execute("PRAGMA user_version").fetchone()[0] == 1


def test_a_tampered_index_row_is_refused_and_evict_uses_the_manifest(tmp_path: Path) -> None:
    outside = canary(tmp_path)
    models = make_models(tmp_path / "src", "a")
    store = Store(tmp_path / "root")
    a = fetch(store, models["a"])
    depth = len(store.layout.blob(SHA).relative_to(tmp_path).parts) - 1
    escape = "/".join([".."] * depth) + "/outside/precious"
    store.index.write(lambda db: db.execute("UPDATE files SET sha256=? WHERE snapshot_id=? AND path=?",
                                            (escape, a.id, a.files[0].path)))
    with pytest.raises(DamagedRecordError, match="sha256"):
        store.get(a.id)
    store.evict(a.id)  # the file list comes from the (valid) manifest, not from the index
    assert store.list() == [] and not a.path.exists()
    assert_untouched(outside)
