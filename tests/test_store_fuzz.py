"""Property tests for reading the store's records: arbitrary bytes or JSON as a manifest, ref or lease never
raise anything but DamagedRecordError, whatever is accepted is safe to use as paths, and a store holding such a
manifest opens, lists, collects garbage and evicts without touching anything outside its root."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures_store import assert_untouched, canary, fetch, make_models
from weightcache.errors import DamagedRecordError
from weightcache.store import Store, collect_garbage, validate_relpath
from weightcache.store.records import is_hex, parse_lease, parse_manifest, parse_ref, snapshot_id_for
from weightcache.store.types import FileEntry

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
hostile_text = st.sampled_from(["../x", "/etc/passwd", "a/../../b", "a//b", ".", "..", "a\0b", "", "ok/file",
                                "ab" * 32, "AB" * 32, "../" * 30 + "x", "x" * 300, "a\\b", "config.json"])
fieldish = hostile_text | json_values
entries = st.fixed_dictionaries(
    {"path": fieldish, "size": st.integers(min_value=-2, max_value=1 << 64) | fieldish, "sha256": fieldish},
    optional={"etag": fieldish, "version_id": fieldish, "mode": json_values})
manifests = st.fixed_dictionaries({
    "version": st.sampled_from([1, 1, 1, 2, "1", None]), "uri": fieldish, "revision": fieldish,
    "created": st.floats() | fieldish, "files": st.lists(entries, max_size=4) | json_values})


def with_id(body: dict[str, Any]) -> tuple[bytes, str]:
    """The manifest named by the id its file list hashes to when it can be computed, else by a fixed id."""
    try:
        body["id"] = snapshot_id_for(FileEntry(**f) for f in body["files"])
    except (TypeError, AttributeError, ValueError):
        body["id"] = "0" * 40
    return json.dumps(body).encode(), body["id"]


def check_accepted(data: bytes, snap_id: str) -> None:
    """Parse; when accepted, every path must be a safe relative path and every digest a hex sha256."""
    try:
        m = parse_manifest(data, snap_id)
    except DamagedRecordError:
        return
    for f in m.files:
        assert validate_relpath(f.path) == f.path
        assert is_hex(f.sha256, 64) and isinstance(f.size, int) and 0 <= f.size < 1 << 63


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_arbitrary_bytes_as_any_record(data: bytes) -> None:
    check_accepted(data, "0" * 40)
    for parse in (parse_ref, parse_lease):
        with contextlib.suppress(DamagedRecordError):
            parse(data)


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_arbitrary_json_as_a_manifest(value: object) -> None:
    check_accepted(json.dumps(value).encode(), "0" * 40)


@settings(max_examples=400, deadline=None)
@given(manifests)
def test_manifest_shaped_json(body: dict[str, Any]) -> None:
    check_accepted(*with_id(body))


@pytest.fixture(scope="module")
def template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A store with one published snapshot, copied for each example."""
    base = tmp_path_factory.mktemp("fuzz-template")
    models = make_models(base / "src", "a")
    store = Store(base / "root")
    fetch(store, models["a"])
    store.close()
    return base / "root"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(body=manifests, raw=st.none() | st.binary(max_size=200))
def test_a_store_holding_any_manifest_opens_lists_and_evicts_inside_its_root(
        template: Path, body: dict[str, Any], raw: bytes | None) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outside = canary(Path(tmp))
        root = Path(tmp) / "store" / "root"
        shutil.copytree(template, root, symlinks=True)
        data, snap_id = with_id(body)
        (root / "manifests" / f"{snap_id}.json").write_bytes(raw if raw is not None else data)
        if snap_id != "0" * 40:
            (root / "snapshots" / snap_id).mkdir(exist_ok=True)
        store = Store(root)
        infos = store.list()
        assert len(infos) >= 1
        collect_garbage(store)
        store.evict_to(0)
        for info in store.list():  # what evict_to leaves holds no bytes (an accepted empty file list)
            assert info.snapshot.size == 0
            store.evict(info.snapshot.id)
        assert store.list() == []
        store.close()
        again = Store(root)
        assert again.list() == []
        assert_untouched(outside)
