"""The startup taint (docs/startup-taint.md): a node created tainted is untainted by its own daemon once the
warm-first ModelCaches are on it, or at the deadline with an Event; other nodes and other taints stay as they are.
Through the stand-in API server (tests/fake_apiserver.py), with real daemons, stores and fetches."""

from __future__ import annotations

import asyncio
import datetime
from pathlib import Path
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer, RequestRecord
from tests.fake_rules import daemon_user
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_kube import NODE
from weightcache.daemon.node import Want
from weightcache.daemon.startup_taint import waiting_on
from weightcache.errors import ClusterError
from weightcache.kube.taint import JSON_PATCH, remove_taint
from weightcache.uri import parse_ref, readiness_label
from weightcache.vocabulary import STARTUP_TAINT, STARTUP_TAINT_EFFECT

OTHER = "gpu-2"
PENDING = {"key": STARTUP_TAINT, "effect": STARTUP_TAINT_EFFECT}
GPU = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def tainted_node(name: str, *taints: dict[str, str]) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": {"pool": "a100"}}, "spec": {"taints": list(taints)}}


def taints(api: FakeApiServer, name: str) -> list[dict[str, Any]]:
    return list(api.get("nodes", name).get("spec", {}).get("taints", []))


def warm_first(name: str, source: str, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name},
            "spec": {"source": source, "nodeSelector": {"pool": "a100"}, "allowedNamespaces": ["*"],
                     "warmBeforeSchedulable": True, **spec}}


def node_events(api: FakeApiServer) -> list[dict[str, Any]]:
    return [e for e in api.list("events", "default") if e["involvedObject"]["kind"] == "Node"]


def model_phase(api: FakeApiServer, name: str) -> str | None:
    if not api.list("modelcachenodes"):
        return None
    phase = api.get("modelcachenodes", NODE).get("status", {}).get("models", {}).get(name, {}).get("phase")
    return str(phase) if phase else None


def model_ready(api: FakeApiServer, name: str) -> bool:
    return model_phase(api, name) == "Ready"


def untaint_request(api: FakeApiServer) -> RequestRecord:
    (patch,) = [r for r in api.requests if r.method == "PATCH" and r.path == f"/api/v1/nodes/{NODE}"
                and r.content_type == JSON_PATCH]
    return patch


def stamp(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


@pytest.fixture
def cluster(apiserver: FakeApiServer, short_dir: Path, monkeypatch: pytest.MonkeyPatch) -> FakeApiServer:
    """Two nodes created tainted: NODE, whose daemon the tests start, and OTHER, which has none."""
    apiserver.create("nodes", tainted_node(NODE, GPU, PENDING))
    apiserver.create("nodes", tainted_node(OTHER, PENDING))
    apiserver.use_as_kubeconfig(short_dir, monkeypatch)
    return apiserver


async def test_a_tainted_node_is_untainted_when_its_models_land(cluster: FakeApiServer, short_dir: Path,
                                                                model_copy: Path) -> None:
    cluster.create("modelcaches", warm_first("llama", f"file://{model_copy}/"))
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    try:
        await eventually(lambda: PENDING not in taints(cluster, NODE), what="the startup taint to go", timeout=30)
        assert taints(cluster, NODE) == [GPU]  # the other taint stays
        assert taints(cluster, OTHER) == [PENDING]  # another node's taint is not this daemon's
        (ready,) = [r for r in cluster.requests if r.method == "PATCH" and "modelcachenodes" in r.path
                    and (r.body or {}).get("status", {}).get("models", {}).get("llama", {}).get("phase") == "Ready"]
        untaint = untaint_request(cluster)
        assert cluster.requests.index(ready) < cluster.requests.index(untaint), "untainted before the model landed"
        assert untaint.body[0] == {"op": "test", "path": "/spec/taints", "value": [GPU, PENDING]}
        (event,) = await eventually(lambda: node_events(cluster), what="the Node's Event", timeout=30)
        assert (event["reason"], event["type"], event["involvedObject"]["name"]) == ("ModelsReady", "Normal", NODE)
        metrics = await asyncio.to_thread(d.client.metrics)
        assert 'weightcache_startup_taint_seconds_count{reason="models_ready"} 1.0' in metrics
    finally:
        await d.daemon.stop()


async def test_at_the_deadline_the_taint_goes_anyway_with_a_warning_event(cluster: FakeApiServer, short_dir: Path,
                                                                          model_copy: Path) -> None:
    cluster.create("modelcaches", warm_first("broken", f"file://{short_dir}/missing/"))
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE}, config={"startupTaintDeadline": 5})
    try:
        await eventually(lambda: PENDING not in taints(cluster, NODE), what="the deadline", timeout=30)
        assert taints(cluster, NODE) == [GPU] and taints(cluster, OTHER) == [PENDING]
        (event,) = await eventually(lambda: node_events(cluster), what="the Node's Event", timeout=30)
        assert (event["reason"], event["type"]) == ("StartupTaintDeadline", "Warning")
        assert "broken" in event["message"] and STARTUP_TAINT in event["message"]
        # not before the deadline (both stamps have whole seconds), though the fetch had failed well before it
        created = cluster.get("nodes", NODE)["metadata"]["creationTimestamp"]
        assert stamp(event["firstTimestamp"]) - stamp(created) >= 5
        failed = [r for r in cluster.requests if r.method == "PATCH" and "modelcachenodes" in r.path
                  and (r.body or {}).get("status", {}).get("models", {}).get("broken", {}).get("phase") == "Failed"]
        assert cluster.requests.index(failed[0]) < cluster.requests.index(untaint_request(cluster))
        metrics = await asyncio.to_thread(d.client.metrics)
        assert 'weightcache_startup_taint_seconds_count{reason="deadline"} 1.0' in metrics
    finally:
        await d.daemon.stop()


async def test_a_node_nothing_asks_to_warm_first_is_untainted_at_once(cluster: FakeApiServer, short_dir: Path,
                                                                     model_copy: Path) -> None:
    cluster.create("modelcaches", warm_first("later", f"file://{model_copy}/", warmBeforeSchedulable=False))
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    try:
        await eventually(lambda: PENDING not in taints(cluster, NODE), what="the startup taint to go", timeout=30)
        assert taints(cluster, NODE) == [GPU]
        await eventually(lambda: model_ready(cluster, "later"), what="the model, fetched all the same", timeout=30)
    finally:
        await d.daemon.stop()


@pytest.mark.shipped_access
async def test_the_shipped_rbac_and_node_policy_let_a_daemon_untaint_its_own_node_only(
        apiserver: FakeApiServer, short_dir: Path, model_copy: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """deploy/daemonset/rbac.yaml and node-policy.yaml enforced by the stand-in for the daemon's node-bound token."""
    apiserver.create("nodes", tainted_node(NODE, GPU, PENDING))
    apiserver.create("nodes", tainted_node(OTHER, PENDING))
    apiserver.create("modelcaches", warm_first("llama", f"file://{model_copy}/"))
    token = apiserver.token_for(daemon_user(NODE))
    apiserver.use_as_kubeconfig(short_dir, monkeypatch, token)
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    try:
        await eventually(lambda: PENDING not in taints(apiserver, NODE), what="the startup taint to go", timeout=30)
        assert taints(apiserver, NODE) == [GPU]
        labels = apiserver.get("nodes", NODE)["metadata"]["labels"]
        assert labels[readiness_label(f"file://{model_copy}/")] == "ready"  # labelled while still tainted
        await eventually(lambda: node_events(apiserver), what="the Node's Event, in namespace default", timeout=30)
        assert apiserver.forbidden == []  # nothing the daemon sent was refused
    finally:
        await d.daemon.stop()
    with pytest.raises(ClusterError) as denied:  # the same token on another node's taint
        await asyncio.to_thread(remove_taint, apiserver.api_client(token), OTHER, STARTUP_TAINT, STARTUP_TAINT_EFFECT)
    assert denied.value.status == 403 and taints(apiserver, OTHER) == [PENDING]


def test_a_taint_another_controller_adds_meanwhile_is_kept(cluster: FakeApiServer) -> None:
    """Between the daemon's read and its patch the node lifecycle controller adds `not-ready`: the patch's `test`
    fails (422), the daemon reads again, and only its own taint goes."""
    not_ready = {"key": "node.kubernetes.io/not-ready", "effect": "NoExecute", "timeAdded": "2026-12-06T05:00:00Z"}

    def meanwhile(request: RequestRecord) -> None:
        if request.method == "PATCH" and cluster.before_request is not None:
            cluster.before_request = None
            node = cluster.get("nodes", NODE)
            node["spec"]["taints"].append(not_ready)
            cluster.update("nodes", NODE, node)

    cluster.before_request = meanwhile
    assert remove_taint(cluster.api_client(), NODE, STARTUP_TAINT, STARTUP_TAINT_EFFECT) is True
    assert taints(cluster, NODE) == [GPU, not_ready]
    assert len(cluster.requests_matching("PATCH", f"/nodes/{NODE}")) == 2  # the first lost the race
    assert remove_taint(cluster.api_client(), NODE, STARTUP_TAINT, STARTUP_TAINT_EFFECT) is False  # gone already


def test_the_last_taint_leaves_no_list_behind(cluster: FakeApiServer) -> None:
    assert remove_taint(cluster.api_client(), OTHER, STARTUP_TAINT, STARTUP_TAINT_EFFECT) is True
    assert "taints" not in cluster.get("nodes", OTHER)["spec"]  # NodeSpec.Taints is omitempty


def test_memory_tier_models_hold_the_taint_until_resident() -> None:
    wanted = [Want("disk", parse_ref("s3://models/disk/"), warm_first=True),
              Want("ram", parse_ref("s3://models/ram/"), "memory", warm_first=True),
              Want("later", parse_ref("s3://models/later/"))]
    assert waiting_on(wanted, {}, frozenset()) == ["disk", "ram"]
    assert waiting_on(wanted, {"disk": "s1", "ram": "s2"}, frozenset()) == ["ram"]  # on disk, not yet in RAM
    assert waiting_on(wanted, {"disk": "s1", "ram": "s2"}, frozenset({"s2"})) == []
