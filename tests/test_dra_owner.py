"""Node-local ResourceSlices are owned by their Node: the publisher reads the Node's uid and puts it in every
slice's ownerReferences (so the garbage collector deletes them with the Node), checked against the official
1.36 schema (strict) through the fake API server and the official client."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fake_apiserver import FakeApiServer, node
from tests.fixtures_dra import NODE, fetch_models
from tests.fixtures_k8s_schema import validate_strict
from tests.test_dra_slices import check_slice, publisher, slices_of
from weightcache.store import Store


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def test_slices_carry_their_node_as_owner_and_validate(tmp_path: Path, store: Store, apiserver: FakeApiServer) -> None:
    created = apiserver.create("nodes", node(NODE))
    fetch_models(store, tmp_path / "src", 1)
    start = time.perf_counter()
    assert publisher(apiserver, store).sync() is True
    print(f"first publish with the Node read: {1000 * (time.perf_counter() - start):.1f} ms")
    [published] = slices_of(apiserver)
    assert published["metadata"]["ownerReferences"] == [
        {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": created["metadata"]["uid"], "controller": True}]
    check_slice(published, "1.34")
    validate_strict(published, "1.36")
    assert apiserver.requests_matching("GET", f"/api/v1/nodes/{NODE}")


def test_a_slice_published_before_its_node_gets_the_owner_later(store: Store, apiserver: FakeApiServer,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    pub = publisher(apiserver, store)
    assert pub.sync() is True
    [orphan] = slices_of(apiserver)
    assert "ownerReferences" not in orphan["metadata"] and "get` on nodes" in caplog.text
    assert pub.sync() is False  # nothing changed in the store: no Node read, no write
    created = apiserver.create("nodes", node(NODE))
    assert pub.sync(full=True) is True  # the periodic full sync reads the Node and adds the owner
    [owned] = slices_of(apiserver)
    assert owned["metadata"]["ownerReferences"][0]["uid"] == created["metadata"]["uid"]
    assert owned["spec"] == {**orphan["spec"], "pool": {**orphan["spec"]["pool"], "generation": 2}}
    apiserver.delete("nodes", NODE)
    recreated = apiserver.create("nodes", node(NODE))  # same name, new uid: the owner follows
    assert pub.sync(full=True) is True
    [again] = slices_of(apiserver)
    assert again["metadata"]["ownerReferences"][0]["uid"] == recreated["metadata"]["uid"]
    assert pub.sync(full=True) is False
