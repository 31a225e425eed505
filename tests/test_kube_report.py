"""NodeReporter: node labels by merge patch, the node's own ModelCacheNode status, Events, no credentials."""

from __future__ import annotations

import logging
import threading

import pytest

from tests.fake_apiserver import FakeApiServer, model_cache, node
from tests.faultproxy import FaultProxy
from tests.test_kube_watch import until
from weightcache.errors import ClusterError
from weightcache.kube.report import ModelState, NodeReporter

NODES = "/api/v1/nodes"
MCN = "/apis/weightcache.io/v1alpha1/modelcachenodes"
LABEL = "weightcache.io/m0123456789abcdef0123"


@pytest.fixture
def server(apiserver: FakeApiServer) -> FakeApiServer:
    apiserver.create("nodes", node("n1", {"gpu": "h100", "weightcache.io/mstale000000000000000": "ready"}))
    apiserver.create("nodes", node("n2", {"gpu": "h100"}))
    return apiserver


def models_of(server: FakeApiServer, node_name: str) -> dict:
    return server.get("modelcachenodes", node_name).get("status", {}).get("models", {})


def test_set_labels_uses_merge_patch_and_none_removes(server):
    reporter = NodeReporter(server.api_client(), "n1")
    reporter.set_labels({LABEL: "fetching"})
    assert server.get("nodes", "n1")["metadata"]["labels"][LABEL] == "fetching"
    reporter.set_labels({LABEL: "ready"})
    reporter.set_labels({LABEL: None})
    labels = server.get("nodes", "n1")["metadata"]["labels"]
    assert LABEL not in labels and labels["gpu"] == "h100"
    assert reporter.node_labels() == labels
    patches = server.requests_matching("PATCH", NODES)
    assert {p.path for p in patches} == {"/api/v1/nodes/n1"}
    assert {p.content_type for p in patches} == {"application/merge-patch+json"}
    assert patches[-1].body == {"metadata": {"labels": {LABEL: None}}}


def test_report_creates_own_object_owned_by_the_node_and_writes_status_subresource(server):
    reporter = NodeReporter(server.api_client(), "n1", min_interval=60)
    reporter.report("llama", ModelState("Fetching", bytes_done=1, bytes_total=10, observed_generation=2))
    obj = server.get("modelcachenodes", "n1")
    assert obj["spec"] == {"nodeName": "n1"}
    owner = obj["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["uid"]) == ("Node", "n1", server.get("nodes", "n1")["metadata"]["uid"])
    state = models_of(server, "n1")["llama"]
    assert state["phase"] == "Fetching" and state["bytesDone"] == 1 and state["observedGeneration"] == 2
    patch = server.requests_matching("PATCH", MCN)[-1]
    assert patch.path == f"{MCN}/n1/status" and patch.content_type == "application/merge-patch+json"


def test_progress_is_coalesced_and_phase_changes_are_immediate(server):
    reporter = NodeReporter(server.api_client(), "n1", min_interval=0.3)
    reporter.report("llama", ModelState("Fetching", bytes_done=0, bytes_total=100))
    for done in range(1, 51):
        reporter.report("llama", ModelState("Fetching", bytes_done=done, bytes_total=100))
    assert reporter.writes <= 2
    until(lambda: models_of(server, "n1")["llama"]["bytesDone"] == 50)  # the timer writes the latest
    reporter.report("llama", ModelState("Ready", bytes_done=100, bytes_total=100, snapshot="abc"))
    assert models_of(server, "n1")["llama"]["phase"] == "Ready"  # at once, without waiting for the interval
    assert reporter.writes <= 3
    reporter.close()


def test_states_reported_from_two_threads_are_written_in_the_order_they_were_taken(server):
    """A fetch's "Fetching" (the reconciler) and its "Ready" a moment later (the fetch's task) are written from two
    threads: their patches crossed on their way to the API server and the stale "Fetching" stayed (a rollout
    stuck at 2/3 in CI), since the reconciler sends a state only once."""
    with FaultProxy(server.url) as proxy:
        api = server.api_client()
        api.configuration.host = proxy.endpoint_url
        reporter = NodeReporter(api, "n1", min_interval=0)
        reporter.report_many({"mistral": ModelState("Ready")})  # its object made: the writes below are patches
        hold = proxy.add("hold", method="PATCH", path=f"{MCN}/n1/status")
        first = threading.Thread(target=reporter.report_many, args=({"llama": ModelState("Fetching")},))
        first.start()
        assert hold.arrived.wait(10)
        second = threading.Thread(target=reporter.report_many, args=({"llama": ModelState("Ready", snapshot="a")},))
        second.start()
        second.join(0.5)  # before: its patch went past the held one and landed first
        hold.release.set()
        first.join(10)
        second.join(10)
        assert models_of(server, "n1")["llama"]["phase"] == "Ready"
        assert [r.body["status"]["models"]["llama"]["phase"] for r in server.requests_matching("PATCH", MCN)
                if "llama" in r.body["status"]["models"]] == ["Fetching", "Ready"]


def test_each_node_writes_only_its_own_object(server):
    a = NodeReporter(server.api_client(), "n1", min_interval=0)
    b = NodeReporter(server.api_client(), "n2", min_interval=0)
    a.report("llama", ModelState("Ready"))
    b.report("llama", ModelState("Failed", message="disk full"))
    a.report("mistral", ModelState("Fetching"))
    assert set(models_of(server, "n1")) == {"llama", "mistral"}
    assert set(models_of(server, "n2")) == {"llama"}
    creates = [r.body["metadata"]["name"] for r in server.requests_matching("POST", MCN)]
    patches = [r.path for r in server.requests_matching("PATCH", MCN)]
    assert sorted(creates) == ["n1", "n2"]
    assert sorted(patches) == [f"{MCN}/n1/status", f"{MCN}/n1/status", f"{MCN}/n2/status"]
    assert not server.requests_matching("PUT", MCN)


def test_forget_removes_the_model_from_status(server):
    reporter = NodeReporter(server.api_client(), "n1", min_interval=0)
    reporter.report("llama", ModelState("Ready"))
    reporter.report("mistral", ModelState("Ready"))
    reporter.forget("llama")
    assert set(models_of(server, "n1")) == {"mistral"}


def test_status_object_deleted_by_hand_is_recreated(server):
    reporter = NodeReporter(server.api_client(), "n1", min_interval=0)
    reporter.report("llama", ModelState("Fetching"))
    server.delete("modelcachenodes", "n1")
    reporter.report("llama", ModelState("Ready"))
    assert models_of(server, "n1")["llama"]["phase"] == "Ready"


def test_invalid_phase_is_refused():
    with pytest.raises(ValueError, match="Pending, Fetching, Ready, Failed"):
        ModelState("Done")  # type: ignore[arg-type]


SECRET_MESSAGE = (
    "GET https://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMI@bucket.example/x?X-Amz-Signature=deadbeef"
    "&X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F "
    "failed; Authorization: Bearer eyJhbGciOi.secret aws_secret_access_key=wJalrXUtnFEMI"
)


def test_credentials_never_reach_status_or_events(server, caplog):
    caplog.set_level(logging.DEBUG)
    reporter = NodeReporter(server.api_client(), "n1", min_interval=0)
    reporter.report("llama", ModelState("Failed", message=SECRET_MESSAGE))
    mc = server.create("modelcaches", model_cache("llama", "s3://models/llama/"))
    reporter.event(mc, "FetchFailed", SECRET_MESSAGE)
    stored = str(server.list("modelcachenodes")) + str(server.list("events"))
    for secret in ("AKIAIOSFODNN7EXAMPLE", "wJalrXUtnFEMI", "deadbeef", "eyJhbGciOi"):
        assert secret not in stored
        assert secret not in caplog.text
    assert "failed" in models_of(server, "n1")["llama"]["message"]


def test_event_is_about_the_model_cache_in_default_and_repeats_count(server):
    reporter = NodeReporter(server.api_client(), "n1")
    mc = server.create("modelcaches", model_cache("llama", "s3://models/llama/"))
    reporter.event(mc, "FetchFailed", "bucket not found")
    reporter.event(mc, "FetchFailed", "bucket not found")
    (event,) = server.list("events")
    assert event["metadata"]["namespace"] == "default"
    assert event["involvedObject"] == {"apiVersion": "weightcache.io/v1alpha1", "kind": "ModelCache", "name": "llama",
                                       "uid": mc["metadata"]["uid"],
                                       "resourceVersion": mc["metadata"]["resourceVersion"]}
    assert event["type"] == "Warning" and event["reason"] == "FetchFailed" and event["count"] == 2
    assert event["source"] == {"component": "weightcache-daemon", "host": "n1"}
    assert server.requests_matching("POST", "/api/v1/namespaces/default/events")
    patch = server.requests_matching("PATCH", "/api/v1/namespaces/default/events/")[0]
    assert patch.content_type == "application/merge-patch+json"


def test_event_failure_is_logged_not_raised(server, caplog):
    # The real API server refuses an Event about a cluster-scoped object outside "default".
    reporter = NodeReporter(server.api_client(), "n1", namespace_for_events="weightcache")
    mc = server.create("modelcaches", model_cache("llama", "s3://models/llama/"))
    reporter.event(mc, "FetchFailed", "x")
    assert server.list("events") == []
    assert "HTTP 422" in caplog.text


def test_an_unchanged_state_writes_nothing(server):
    reporter = NodeReporter(server.api_client(), "n1", min_interval=0)
    reporter.report("llama", ModelState("Ready", snapshot="abc", time="2026-01-01T00:00:00Z"))
    reporter.report("llama", ModelState("Ready", snapshot="abc"))  # only the time differs
    assert reporter.writes == 1
    reporter.report("llama", ModelState("Ready", snapshot="def"))
    assert reporter.writes == 2


def test_api_failures_raise_cluster_error_and_are_retried(server):
    reporter = NodeReporter(server.api_client(), "n1", min_interval=0)
    reporter.report("llama", ModelState("Fetching"))
    server.fail_requests = 1
    with pytest.raises(ClusterError, match="HTTP 500") as info:
        reporter.report("llama", ModelState("Ready"))
    assert "Authorization" not in str(info.value) and "HTTP response" not in str(info.value)
    reporter.flush()  # the failed state is still pending
    assert models_of(server, "n1")["llama"]["phase"] == "Ready"
    server.fail_requests = 1
    with pytest.raises(ClusterError):
        reporter.set_labels({LABEL: "ready"})


def test_unreachable_api_server_is_a_cluster_error(server):
    client = server.api_client()
    server.stop()
    reporter = NodeReporter(client, "n1", min_interval=0)
    with pytest.raises(ClusterError, match="unreachable"):
        reporter.set_labels({LABEL: "ready"})
    reporter.event(model_cache("llama", "s3://models/llama/"), "FetchFailed", "x")  # best effort: no raise


def test_status_sums_up_the_models_for_kubectl_get_mcn(server):
    """The CRD's printer columns read `ready` and `progress`: the patch carries the sums over every model this
    node reports, not only the ones the patch changes."""
    reporter = NodeReporter(server.api_client(), "n1", min_interval=0)
    reporter.report("llama", ModelState("Ready", bytes_done=2 << 30, bytes_total=2 << 30))
    reporter.report("mistral", ModelState("Fetching", bytes_done=1 << 30, bytes_total=4 << 30))
    status = server.get("modelcachenodes", "n1")["status"]
    assert status["ready"] == "1/2" and status["progress"] == "3 GiB / 6 GiB"
    reporter.forget("mistral")
    status = server.get("modelcachenodes", "n1")["status"]
    assert status["ready"] == "1/1" and status["progress"] == "2 GiB / 2 GiB"
