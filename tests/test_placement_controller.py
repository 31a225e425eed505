"""The placement controller against the fake API server (real `kubernetes` client, real watches, the API
server's rules for updating gated pods): demand, release only to ready nodes and only once ready, progress
Events, garbage collection, RAM-tier picks, and a leader change on one Lease without losing a demand."""

from __future__ import annotations

import io
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_daemon import wait_until
from tests.fixtures_k8s_schema import validate_strict
from tests.fixtures_webhook import REF, admission_review, apply_response, deployment_pod
from weightcache.kube import cluster_cli
from weightcache.placement import choice
from weightcache.placement.controller import CONTROLLER, Controller
from weightcache.placement.lease import LeaderElector
from weightcache.placement.nodes import node_facts
from weightcache.uri import parse_ref
from weightcache.webhook.mutate import review

NS = "inference"
LABEL = parse_ref(REF).label_key
DEMAND = choice.demand_name(parse_ref(REF))
MERGE = "application/merge-patch+json"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def gpu_node(name: str, labels: dict[str, str] | None = None, *, gpus: int = 1,
             taints: list[dict[str, str]] | None = None) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": dict(labels or {})},
            "spec": {"taints": taints or []}, "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}}}


def admitted_pod(api: FakeApiServer, name: str, **spec: Any) -> dict[str, Any]:
    """A pod as the webhook leaves it (gated: no node holds the model), created in the API."""
    pod = deployment_pod({"weightcache.io/model": REF})
    pod["metadata"]["name"] = name
    pod["spec"].update(spec)
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    nodes = [node_facts(n) for n in api.list("nodes")]
    patched = apply_response(pod, review(admission_review(pod), model_caches=[], allow_undeclared=True, nodes=nodes))
    assert patched["spec"]["schedulingGates"] == [{"name": choice.GATE}]
    return api.create("pods", patched, NS)


def set_label(api: FakeApiServer, node: str, value: str | None) -> None:
    api.patch("nodes", node, {"metadata": {"labels": {LABEL: value}}}, MERGE)


def report(api: FakeApiServer, node: str, phase: str, done: int, total: int) -> None:
    try:
        api.get("modelcachenodes", node)
    except Exception:
        api.create("modelcachenodes", {"apiVersion": "weightcache.io/v1alpha1", "kind": "ModelCacheNode",
                                       "metadata": {"name": node}, "spec": {"nodeName": node}})
    api.patch("modelcachenodes", node, {"status": {"models": {DEMAND: {
        "phase": phase, "bytesDone": done, "bytesTotal": total}}}}, MERGE, subresource="status")


def demand_nodes(api: FakeApiServer) -> list[str] | None:
    try:
        return list(api.get("modelcaches", DEMAND)["spec"].get("nodeNames") or [])
    except Exception:
        return None


def gated(api: FakeApiServer, name: str) -> bool:
    return choice.gated(api.get("pods", name, NS))


def settle(ctl: Controller, passes: int = 3) -> None:
    """Let the controller run `passes` more passes (it acts on what it saw: wait for it, not for time)."""
    start = ctl.passes
    wait_until(lambda: ctl.passes >= start + passes, what=f"{passes} controller passes")


def grant(api: FakeApiServer, name: str, source: str, namespaces: list[str]) -> None:
    """A cluster admin's ModelCache that lets `namespaces` mount `source` (and prefetches it nowhere)."""
    api.create("modelcaches", {"apiVersion": "weightcache.io/v1alpha1", "kind": "ModelCache",
                               "metadata": {"name": name}, "spec": {"source": source, "allowedNamespaces": namespaces}})


@pytest.fixture
def api(apiserver: FakeApiServer) -> FakeApiServer:
    grant(apiserver, "grant-llama", REF, [NS])  # demand is made only for pods the policy allows
    return apiserver


@pytest.fixture
def controller(api: FakeApiServer) -> Iterator[Controller]:
    ctl = Controller(api.api_client(), event_interval=0.5, resync=0.1)
    ctl.start()
    yield ctl
    ctl.stop()


def test_gated_pod_is_released_only_to_ready_nodes_and_only_once_ready(api: FakeApiServer,
                                                                       controller: Controller) -> None:
    api.create("nodes", gpu_node("gpu-a", {"pool": "a100"}))
    api.create("nodes", gpu_node("gpu-b", {"pool": "a100"}, taints=[{"key": "maint", "effect": "NoSchedule"}]))
    api.create("nodes", gpu_node("cpu-1", {"pool": "cpu"}, gpus=0))
    admitted_pod(api, "llama-0", nodeSelector={"pool": "a100"})

    assert wait_until(lambda: demand_nodes(api), what="demand") == ["gpu-a"], "only the node the pod may run on"
    mc = api.get("modelcaches", DEMAND)
    assert mc["metadata"]["labels"]["app.kubernetes.io/managed-by"] == CONTROLLER
    assert mc["spec"]["source"] == REF and not mc["spec"].get("allowedNamespaces"), "demand grants nothing"
    table = io.StringIO()
    assert cluster_cli.status(api.api_client(), None, out=table) == 0
    row = next(line for line in table.getvalue().splitlines() if line.startswith(DEMAND))
    assert f"(pods wait: {REF})" in row and "gpu-a" in row and "Pending" in row, table.getvalue()

    set_label(api, "gpu-b", "ready")  # tainted: the pod may not run there
    set_label(api, "cpu-1", "ready")  # wrong pool
    settle(controller)
    assert gated(api, "llama-0"), "released although no node it may run on holds the model"

    report(api, "gpu-a", "Fetching", 400_000_000, 1_600_000_000)
    event = wait_until(lambda: [e for e in api.list("events", NS) if e["involvedObject"]["name"] == "llama-0"
                                and e["reason"] == "FetchingModel" and "25%" in e["message"]],
                       what="a progress Event")[0]
    assert "gpu-a" in event["message"]
    validate_strict(event)
    report(api, "gpu-a", "Fetching", 800_000_000, 1_600_000_000)
    wait_until(lambda: "50%" in (m := api.get("events", "llama-0.weightcache-placement", NS)["message"]) and "ETA" in m,
               what="the Event to show the new bytes and an ETA")

    report(api, "gpu-a", "Ready", 1_600_000_000, 1_600_000_000)
    settle(controller)
    assert gated(api, "llama-0"), "a report alone is not readiness: the scheduler reads the label"
    set_label(api, "gpu-a", "ready")
    wait_until(lambda: not gated(api, "llama-0"), what="the release")
    pod = api.get("pods", "llama-0", NS)
    validate_strict(pod)
    terms = pod["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": LABEL, "operator": "In", "values": ["ready"]}]}]
    assert pod["spec"]["nodeSelector"] == {"pool": "a100"}, "the pod's own constraints stay"

    # Released but not yet bound: the demand stays (its label keeps the pod's affinity satisfiable).
    settle(controller)
    assert demand_nodes(api) == ["gpu-a"]
    api.delete("pods", "llama-0", NS)
    wait_until(lambda: demand_nodes(api) is None, what="the demand to be garbage-collected")


def test_release_keeps_the_pods_own_required_terms(api: FakeApiServer, controller: Controller) -> None:
    """Adding expressions to every existing term is what the API server allows on a gated pod (the fake
    enforces it): a pod with its own required affinity is released with ours ANDed into each of its terms."""
    api.create("nodes", gpu_node("gpu-a", {"zone": "z1"}))
    own = {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "zone", "operator": "In", "values": ["z1"]}]},
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["gpu-x"]}]}]}}}
    admitted_pod(api, "llama-1", affinity=own)
    wait_until(lambda: demand_nodes(api) == ["gpu-a"], what="demand")
    set_label(api, "gpu-a", "ready")
    wait_until(lambda: not gated(api, "llama-1"), what="the release")
    terms = api.get("pods", "llama-1", NS)["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    ours = {"key": LABEL, "operator": "In", "values": ["ready"]}
    zone_z1 = {"key": "zone", "operator": "In", "values": ["z1"]}
    assert terms[0]["matchExpressions"] == [zone_z1, ours]
    assert terms[1]["matchExpressions"] == [ours] and terms[1]["matchFields"][0]["values"] == ["gpu-x"]


def test_fake_refuses_what_the_api_server_refuses_on_pods(api: FakeApiServer) -> None:
    api.create("nodes", gpu_node("gpu-a"))
    admitted_pod(api, "p")
    with pytest.raises(Exception, match="only deletion is allowed"):
        api.patch("pods", "p", {"spec": {"schedulingGates": [{"name": choice.GATE}, {"name": "x"}]}}, MERGE,
                  namespace=NS)
    api.patch("pods", "p", {"spec": {"schedulingGates": None}}, MERGE, namespace=NS)
    with pytest.raises(Exception, match="nodeSelector"):
        api.patch("pods", "p", {"spec": {"nodeSelector": {"a": "b"}}}, MERGE, namespace=NS)


def test_no_node_for_the_pod_is_a_warning_and_no_demand(api: FakeApiServer, controller: Controller) -> None:
    api.create("nodes", gpu_node("gpu-a", {"pool": "a100"}))
    admitted_pod(api, "odd", nodeSelector={"pool": "tpu"})
    event = wait_until(lambda: [e for e in api.list("events", NS) if e["involvedObject"]["name"] == "odd"],
                       what="a warning Event")[0]
    assert event["type"] == "Warning" and event["reason"] == "NoNodeForModel"
    assert demand_nodes(api) is None and gated(api, "odd")


def test_progress_events_are_rate_limited(api: FakeApiServer) -> None:
    api.create("nodes", gpu_node("gpu-a"))
    ctl = Controller(api.api_client(), event_interval=1.0, resync=0.05)
    ctl.start()
    try:
        admitted_pod(api, "llama-0")
        wait_until(lambda: demand_nodes(api), what="demand")
        start = time.monotonic()
        for i in range(30):
            report(api, "gpu-a", "Fetching", i * 1_000_000, 100_000_000)
            time.sleep(0.05)
        elapsed = time.monotonic() - start
        writes = [r for r in api.requests if "/events" in r.path and r.method in ("POST", "PATCH")]
        assert 1 <= len(writes) <= elapsed / 1.0 + 2, (len(writes), elapsed)
    finally:
        ctl.stop()


def test_memory_nodes_are_picked_across_zones(api: FakeApiServer, controller: Controller) -> None:
    zone = "topology.kubernetes.io/zone"
    for i, z in enumerate(("a", "a", "b")):
        api.create("nodes", gpu_node(f"n{i}", {zone: z, "pool": "gpu"}))
    api.create("modelcaches", {"apiVersion": "weightcache.io/v1alpha1", "kind": "ModelCache",
                               "metadata": {"name": "llama"},
                               "spec": {"source": REF, "nodeSelector": {"pool": "gpu"}, "memory": {"nodes": 2}}})
    # the controller may pick before its informer has seen all three nodes (['n0'] from a view of one): a later
    # pass spreads the picks over the zones it sees, so wait for the spread rather than take the first status
    wait_until(lambda: (picked := (api.get("modelcaches", "llama").get("status") or {}).get("memoryNodes") or [])
               and len(picked) == 2 and "n2" in picked, what="two memoryNodes, one per zone")
    api.delete("nodes", "n2")
    wait_until(lambda: api.get("modelcaches", "llama")["status"]["memoryNodes"] == ["n0", "n1"],
               what="a replacement for the deleted node")


def test_leader_change_keeps_demand_and_releases_nothing_early(api: FakeApiServer) -> None:
    api.create("nodes", gpu_node("gpu-a"))

    def candidate(identity: str) -> Controller:
        elector = LeaderElector(api.api_client(), namespace="weightcache", name="placement", identity=identity,
                                lease_duration=4.0, renew_deadline=3.0, retry_period=0.3)
        ctl = Controller(api.api_client(), elector=elector, event_interval=0.5, resync=0.1)
        ctl.start()
        return ctl

    first = candidate("pod-1")
    wait_until(first.leading, what="the first candidate to lead")
    second = candidate("pod-2")
    try:
        admitted_pod(api, "llama-0")
        wait_until(lambda: demand_nodes(api) == ["gpu-a"], what="demand from the leader")
        settle(first)
        assert not second.leading() and second.passes == 0, "a follower does nothing"

        first.stop(release=False)  # crash: the Lease runs out on its own
        wait_until(second.leading, what="the second candidate to take over")
        assert api.get("leases", "placement", "weightcache")["spec"]["holderIdentity"] == "pod-2"
        settle(second)
        assert gated(api, "llama-0") and demand_nodes(api) == ["gpu-a"]
        assert not api.requests_matching("DELETE", "/modelcaches"), "no demand was dropped on the way"

        set_label(api, "gpu-a", "ready")
        wait_until(lambda: not gated(api, "llama-0"), what="the new leader to release the pod")
        lease = api.get("leases", "placement", "weightcache")
        validate_strict(lease)
        assert lease["spec"]["leaseTransitions"] == 1
    finally:
        first.stop(release=False)
        second.stop()
    assert api.get("leases", "placement", "weightcache")["spec"]["holderIdentity"] == "", "released on shutdown"


def test_a_ready_node_without_room_does_not_release_while_a_node_with_room_fetches(api: FakeApiServer,
                                                                                  controller: Controller) -> None:
    api.create("nodes", gpu_node("busy", {LABEL: "ready"}))
    api.create("pods", {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "other", "namespace": NS},
                        "spec": {"nodeName": "busy", "containers": [{"name": "c", "image": "x", "resources": {
                            "limits": {"nvidia.com/gpu": "1"}}}]}}, NS)
    api.create("nodes", gpu_node("idle"))
    # the controller's node watch must have seen both nodes: with only `busy` (no room anywhere) it would
    # rightly release the pod there
    wait_until(lambda: len(controller.nodes.items()) == 2 and len(controller.pods.items()) == 1, what="the watches")
    pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/placement": "gate"})
    pod["metadata"]["name"] = "llama-2"
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    nodes = [node_facts(n) for n in api.list("nodes")]
    api.create("pods", apply_response(pod, review(admission_review(pod), model_caches=[], allow_undeclared=True,
                                                   nodes=nodes)), NS)
    assert gated(api, "llama-2"), "placement: gate holds the pod even though a node holds the model"
    wait_until(lambda: "idle" in (demand_nodes(api) or []), what="the node with a free GPU to be asked")
    settle(controller)
    assert gated(api, "llama-2"), "released to a node whose only GPU is taken"
    set_label(api, "idle", "ready")
    wait_until(lambda: not gated(api, "llama-2"), what="the release once the node with room is ready")


def test_lease_takeover_only_after_the_record_stood_still_for_the_lease_duration(api: FakeApiServer) -> None:
    """Both candidates measure on one held clock that the test moves (no sleeps): each step lands exactly where
    it says, on either side of the lease duration and renew deadline."""
    now = [1000.0]

    def elector(identity: str) -> LeaderElector:
        return LeaderElector(api.api_client(), namespace="ns", name="l", identity=identity,
                             lease_duration=1.0, renew_deadline=0.5, retry_period=0.1, clock=lambda: now[0])

    a, b = elector("a"), elector("b")
    assert a.try_acquire_or_renew() and a.is_leader()
    assert not b.try_acquire_or_renew(), "held and fresh"
    now[0] += 0.6
    assert not a.is_leader(), "past renew_deadline without a renewal"
    assert a.try_acquire_or_renew() and a.is_leader(), "renewal"
    assert not b.try_acquire_or_renew(), "a renewed record restarts the wait"
    now[0] += 0.9
    assert not b.try_acquire_or_renew(), "the record stood still for less than the lease duration"
    now[0] += 0.2
    assert b.try_acquire_or_renew() and b.is_leader(), "the holder stopped renewing for a lease duration"
    assert not a.try_acquire_or_renew()
    now[0] += 0.6
    assert not a.is_leader(), "a leader that cannot renew stops leading within renew_deadline"
    lease = api.get("leases", "l", "ns")
    assert (lease["spec"]["holderIdentity"], lease["spec"]["leaseTransitions"]) == ("b", 1)


def test_a_hand_written_model_cache_gets_its_model_key_label(api: FakeApiServer, controller: Controller) -> None:
    """The DRA claim policy finds a model's ModelCaches by `weightcache.io/model-key`; one applied by hand without
    it (or with a wrong one) is labelled by the controller, so its allowedNamespaces protect the model's devices."""
    from weightcache.dra.admission import MODEL_KEY_LABEL, model_key_label

    grant(api, "by-hand", "s3://models/other/", ["team-a"])
    wrong = api.get("modelcaches", "grant-llama")
    wrong["metadata"].setdefault("labels", {})[MODEL_KEY_LABEL] = "m" + "0" * 20
    api.update("modelcaches", "grant-llama", wrong)
    for name, source in (("by-hand", "s3://models/other/"), ("grant-llama", REF)):
        wait_until(lambda n=name, s=source: (api.get("modelcaches", n)["metadata"].get("labels") or {}).get(
            MODEL_KEY_LABEL) == model_key_label(s), what=f"the key label on {name}")
