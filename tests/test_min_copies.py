"""Keep a cluster's last copies (ModelCache spec.minCopies, weightcache/kube/copies.py): a node's store refuses to
evict one of the last copies while the ModelCache wants them, evicts it once enough other nodes hold it, and evicts
it anyway, saying so, when its disk is below the free-space floor. The holders are the Nodes' readiness labels and
the ModelCache is read through the stand-in API server, which checks the spec against the shipped CRD schema."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
from kubernetes.client import CoreV1Api, CustomObjectsApi
from kubernetes.client.exceptions import ApiException

from tests.fake_apiserver import FakeApiServer, model_cache, node
from tests.fixtures_store import fetch, make_models
from weightcache.daemon.reconcile import stored_labels
from weightcache.errors import InUseError
from weightcache.kube.copies import Keeper
from weightcache.store import Store
from weightcache.store.store import disk_free
from weightcache.uri import parse_ref
from weightcache.vocabulary import GROUP, MODELCACHES, VERSION

ME = "gpu-1"


def _caches(server: FakeApiServer) -> list[dict[str, Any]]:
    listing = CustomObjectsApi(server.api_client()).list_cluster_custom_object(GROUP, VERSION, MODELCACHES)
    return list(listing.get("items") or [])


def _hold(server: FakeApiServer, name: str, label: str) -> None:
    CoreV1Api(server.api_client()).patch_node(name, {"metadata": {"labels": {label: "ready"}}})


def test_the_last_copies_stay_until_others_hold_them_or_the_disk_is_past_its_floor(
        apiserver: FakeApiServer, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = make_models(tmp_path / "src", "llama")["llama"]
    source = f"file://{model}/"
    label = parse_ref(source).label_key
    for name in (ME, "gpu-2", "gpu-3"):
        apiserver.create("nodes", node(name, {}))
    custom = CustomObjectsApi(apiserver.api_client())
    with pytest.raises(ApiException) as bad:  # the CRD bounds it
        custom.create_cluster_custom_object(GROUP, VERSION, MODELCACHES, model_cache("bad", source, minCopies=-1))
    assert bad.value.status == 422 and "minCopies" in str(bad.value.body)
    custom.create_cluster_custom_object(GROUP, VERSION, MODELCACHES, model_cache("llama", source, minCopies=2))

    store = Store(tmp_path / "root", min_free_bytes=0, min_free_percent=0)
    store.keeper = Keeper(apiserver.api_client(), ME, lambda: _caches(apiserver), lambda: stored_labels(store))
    sid = fetch(store, model).id
    _hold(apiserver, ME, label)

    # the only copy, then one of two: refused, naming the ModelCache that wants it and who holds it
    with pytest.raises(InUseError, match=r"last copies of ModelCache llama, which wants 2 \(minCopies\); "
                                         r"1 node\(s\) hold it: gpu-1"):
        store.evict(sid)
    _hold(apiserver, "gpu-2", label)
    with pytest.raises(InUseError, match=r"2 node\(s\) hold it: gpu-1, gpu-2"):
        store.evict(sid)
    assert store.evict_to(0, best_effort=True) == [] and store.get(sid)  # making room passes it over too

    # below the floor the node's disk comes first: evicted, and the log says what it cost the cluster
    free, _ = disk_free(store.root)
    store.set_limits(budget_bytes=None, min_free_bytes=free + (1 << 30), min_free_percent=0, set_by="test")
    with caplog.at_level(logging.WARNING, logger="weightcache.store.store"):
        assert store.restore_floor() == [sid]
    assert any(f"evicted snapshot {sid} although it is one of the last copies of ModelCache llama" in r.getMessage()
               and "below its free-space floor" in r.getMessage() for r in caplog.records), caplog.text

    # a third node holds it: this copy is no longer one of the last two, an eviction goes through
    store.set_limits(budget_bytes=None, min_free_bytes=0, min_free_percent=0, set_by="test")
    sid = fetch(store, model).id
    _hold(apiserver, "gpu-3", label)
    store.evict(sid)
    assert store.list() == []


def test_a_model_nobody_asks_copies_of_is_evicted_as_before(apiserver: FakeApiServer, tmp_path: Path) -> None:
    model = make_models(tmp_path / "src", "llama")["llama"]
    apiserver.create("nodes", node(ME, {}))
    CustomObjectsApi(apiserver.api_client()).create_cluster_custom_object(
        GROUP, VERSION, MODELCACHES, model_cache("llama", f"file://{model}/"))
    store = Store(tmp_path / "root", min_free_bytes=0, min_free_percent=0)
    store.keeper = Keeper(apiserver.api_client(), ME, lambda: _caches(apiserver), lambda: stored_labels(store))
    sid = fetch(store, model).id
    assert store.evict_to(0) == [sid]
