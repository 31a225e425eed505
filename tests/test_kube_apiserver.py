"""The fake API server is only useful if it refuses what the real one refuses: check that with the official client."""

from __future__ import annotations

import json

import kubernetes
import pytest
import urllib3

from tests.fake_apiserver import FakeApiServer, model_cache, node

G, V = "weightcache.io", "v1alpha1"
ApiException = kubernetes.client.exceptions.ApiException


@pytest.fixture
def server(apiserver: FakeApiServer) -> FakeApiServer:
    return apiserver


@pytest.fixture
def custom(server) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(server.api_client())


@pytest.fixture
def core(server) -> kubernetes.client.CoreV1Api:
    return kubernetes.client.CoreV1Api(server.api_client())


def status_of(exc: ApiException) -> dict:
    body = json.loads(exc.body)
    assert body["kind"] == "Status" and body["code"] == exc.status
    return body


def test_wrong_group_version_or_plural_is_404(custom):
    wrong = ((G, "v1", "modelcaches"), ("weightcache.example", V, "modelcaches"), (G, V, "modelcache"))
    for group, version, plural in wrong:
        with pytest.raises(ApiException) as info:
            custom.list_cluster_custom_object(group, version, plural)
        assert info.value.status == 404


def test_cluster_scoped_resource_under_a_namespace_is_404(custom):
    with pytest.raises(ApiException) as info:
        custom.list_namespaced_custom_object(G, V, "default", "modelcaches")
    assert info.value.status == 404


def test_create_twice_is_409_already_exists(custom):
    custom.create_cluster_custom_object(G, V, "modelcaches", model_cache("a", "s3://models/a/"))
    with pytest.raises(ApiException) as info:
        custom.create_cluster_custom_object(G, V, "modelcaches", model_cache("a", "s3://models/a/"))
    assert status_of(info.value)["reason"] == "AlreadyExists"


def test_custom_resources_refuse_strategic_merge_patch(custom):
    custom.create_cluster_custom_object(G, V, "modelcaches", model_cache("a", "s3://models/a/"))
    with pytest.raises(ApiException) as info:
        custom.patch_cluster_custom_object(G, V, "modelcaches", "a", {"spec": {"tier": "memory"}},
                                           _content_type="application/strategic-merge-patch+json")
    assert info.value.status == 415
    add_tier = [{"op": "add", "path": "/spec/tier", "value": "memory"}]
    custom.patch_cluster_custom_object(G, V, "modelcaches", "a", add_tier, _content_type="application/json-patch+json")
    assert custom.get_cluster_custom_object(G, V, "modelcaches", "a")["spec"]["tier"] == "memory"


def test_node_patch_without_explicit_type_is_strategic_merge_and_null_deletes(core, server):
    server.create("nodes", node("n1", {"a": "1", "b": "2"}))
    core.patch_node("n1", {"metadata": {"labels": {"a": None, "c": "3"}}})
    assert server.requests[-1].content_type == "application/strategic-merge-patch+json"
    assert server.get("nodes", "n1")["metadata"]["labels"] == {"b": "2", "c": "3"}
    raw = urllib3.PoolManager().request("PATCH", f"{server.url}/api/v1/nodes/n1", body=b"<labels/>",
                                        headers={"Content-Type": "application/xml"})
    assert raw.status == 415 and json.loads(raw.data)["reason"] == "UnsupportedMediaType"


def test_replace_needs_current_resource_version(custom):
    created = custom.create_cluster_custom_object(G, V, "modelcaches", model_cache("a", "s3://models/a/"))
    body = dict(created)
    body["metadata"] = {"name": "a"}
    with pytest.raises(ApiException) as info:
        custom.replace_cluster_custom_object(G, V, "modelcaches", "a", body)
    assert info.value.status == 422
    custom.patch_cluster_custom_object(G, V, "modelcaches", "a", {"spec": {"priority": 1}})
    with pytest.raises(ApiException) as info:
        custom.replace_cluster_custom_object(G, V, "modelcaches", "a", created)  # stale version
    assert status_of(info.value)["reason"] == "Conflict"


def test_status_subresource_separates_spec_and_status(custom):
    ready = {"models": {"x": {"phase": "Ready"}}}
    custom.create_cluster_custom_object(G, V, "modelcachenodes",
                                        {"metadata": {"name": "n1"}, "spec": {"nodeName": "n1"}, "status": ready})
    assert "status" not in custom.get_cluster_custom_object(G, V, "modelcachenodes", "n1")  # ignored on create
    custom.patch_cluster_custom_object(G, V, "modelcachenodes", "n1", {"status": {"models": {"x": {"phase": "Ready"}}}})
    assert "status" not in custom.get_cluster_custom_object(G, V, "modelcachenodes", "n1")  # main resource ignores it
    custom.patch_cluster_custom_object_status(G, V, "modelcachenodes", "n1",
                                              {"spec": {"nodeName": "other"}, "status": ready})
    obj = custom.get_cluster_custom_object(G, V, "modelcachenodes", "n1")
    assert obj["status"]["models"]["x"]["phase"] == "Ready" and obj["spec"]["nodeName"] == "n1"


def test_schema_violations_are_422_invalid(custom):
    with pytest.raises(ApiException) as info:
        custom.create_cluster_custom_object(G, V, "modelcaches", model_cache("a", "s3://models/a/", tier="ssd"))
    assert status_of(info.value)["reason"] == "Invalid"
    with pytest.raises(ApiException) as info:
        custom.create_cluster_custom_object(G, V, "modelcaches", model_cache("Not_DNS", "s3://models/a/"))
    assert info.value.status == 422


def test_list_pages_with_limit_and_continue_and_label_selector(core, server):
    for i in range(5):
        server.create("nodes", node(f"n{i}", {"gpu": "h100" if i % 2 else "a10"}))
    first = core.list_node(limit=2)
    assert [n.metadata.name for n in first.items] == ["n0", "n1"] and first.metadata.remaining_item_count == 3
    second = core.list_node(limit=2, _continue=first.metadata._continue)
    assert [n.metadata.name for n in second.items] == ["n2", "n3"]
    assert [n.metadata.name for n in core.list_node(label_selector="gpu=h100").items] == ["n1", "n3"]
    server.expire_before(server.resource_version + 1)
    with pytest.raises(ApiException) as info:
        core.list_node(limit=2, _continue=second.metadata._continue)
    assert info.value.status == 410


def test_watch_from_zero_replays_current_objects_then_times_out(custom, server):
    server.create("modelcaches", model_cache("a", "s3://models/a/"))
    events = list(kubernetes.watch.Watch().stream(custom.list_cluster_custom_object, G, V, "modelcaches",
                                                  resource_version="0", timeout_seconds=1))
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("ADDED", "a")]


def test_watch_from_an_expired_version_is_410(custom, server):
    server.create("modelcaches", model_cache("a", "s3://models/a/"))
    server.expire_before(server.resource_version + 1)
    with pytest.raises(ApiException) as info:
        list(kubernetes.watch.Watch().stream(custom.list_cluster_custom_object, G, V, "modelcaches",
                                             resource_version="101", timeout_seconds=1))
    assert info.value.status == 410


def test_event_for_cluster_scoped_object_must_be_in_default(core):
    event = {"metadata": {"name": "e1"}, "involvedObject": {"kind": "ModelCache", "name": "a"}, "reason": "X",
             "message": "m"}
    with pytest.raises(ApiException) as info:
        core.create_namespaced_event("weightcache", event)
    assert info.value.status == 422
    core.create_namespaced_event("default", event)
