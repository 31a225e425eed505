"""Placement as pure functions: node eligibility, the webhook's gate/require/prefer decision, node choice,
RAM-tier spreading over zones, and how the daemon reads the controller's demand (kube.desired)."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures_webhook import REF, admission_review, apply_response, check_pod, deployment_pod
from weightcache.kube.desired import plan as desired_plan
from weightcache.placement import choice
from weightcache.placement.nodes import NodeFacts, eligible, gpu_request, node_facts
from weightcache.uri import parse_ref
from weightcache.webhook.mutate import review

LABEL = parse_ref(REF).label_key
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def facts(name: str, labels: dict[str, str] | None = None, *, gpus: int = 0, used: int = 0,
          taints: tuple[dict[str, Any], ...] = ()) -> NodeFacts:
    return NodeFacts(name, dict(labels or {}), taints, False, gpus, used)


def pod(annotations: dict[str, str] | None = None, **spec: Any) -> dict[str, Any]:
    p = deployment_pod({"weightcache.io/model": REF, **(annotations or {})})
    p["metadata"]["name"] = p["metadata"].pop("generateName") + "x"
    p["spec"].update(spec)
    return p


# eligibility --------------------------------------------------------------------------------------------------
def test_node_selector_affinity_and_taints_decide_eligibility() -> None:
    gpu_taint = ({"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"},)
    a100 = facts("a", {"pool": "a100", "zone": "z1"}, taints=gpu_taint)
    h100 = facts("b", {"pool": "h100"})
    plain = pod()
    assert not eligible(plain, a100), "an untolerated NoSchedule taint keeps the pod off"
    assert eligible(plain, h100)
    tolerant = pod(tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}])
    assert eligible(tolerant, a100)
    assert eligible(pod(tolerations=[{"operator": "Exists"}]), a100), "an empty key with Exists tolerates all"
    assert not eligible(pod(tolerations=[{"key": "nvidia.com/gpu", "value": "other", "effect": "NoSchedule"}]), a100)
    assert not eligible(pod(nodeSelector={"pool": "a100"}), h100)
    affinity = {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["x"]}]},  # ORed with the next term
        {"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["a100"]},
                              {"key": "zone", "operator": "DoesNotExist"}]},
    ]}}}
    assert eligible(pod(affinity=affinity), h100) and not eligible(pod(affinity=affinity), facts("c", {"zone": "z"}))
    by_name = {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
        {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["b"]}]}]}}}
    assert eligible(pod(affinity=by_name), h100) and not eligible(pod(affinity=by_name), facts("c"))
    empty_term = {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [{}]}}}
    assert not eligible(pod(affinity=empty_term), h100), "an empty term matches no node"
    assert not eligible(plain, NodeFacts("u", {}, (), True)), "cordoned nodes take no new pods"


def test_gpu_counting_from_node_and_pods_is_robust_to_garbage() -> None:
    node = {"metadata": {"name": "n"}, "status": {"allocatable": {"nvidia.com/gpu": "8"}},
            "spec": {"taints": "not-a-list"}}
    gpu_pod = pod()
    gpu_pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "2"}}
    done = pod()
    done["spec"]["containers"][0]["resources"] = {"requests": {"nvidia.com/gpu": "4"}}
    done["status"] = {"phase": "Succeeded"}
    weird = pod()
    weird["spec"]["containers"][0]["resources"] = {"requests": {"nvidia.com/gpu": "half"}}
    f = node_facts(node, [gpu_pod, done, weird])
    assert (f.gpus_allocatable, f.gpus_requested, f.gpus_free, f.taints) == (8, 2, 6, ())
    assert gpu_request(gpu_pod) == 2 and gpu_request(weird) == 0


# webhook ------------------------------------------------------------------------------------------------------
def admit(p: dict[str, Any], nodes: list[NodeFacts] | None) -> dict[str, Any]:
    answer = review(admission_review(p), model_caches=[], allow_undeclared=True, nodes=nodes)
    assert answer["response"]["allowed"], answer
    patched = apply_response(p, answer)
    check_pod(patched)  # strict schema: schedulingGates and affinity as the API server takes them
    return patched


def test_webhook_gates_when_no_node_the_pod_may_run_on_holds_the_model() -> None:
    p = deployment_pod({"weightcache.io/model": REF})
    p["spec"]["nodeSelector"] = {"pool": "a100"}
    ready_elsewhere = [facts("h", {"pool": "h100", LABEL: "ready"}), facts("a", {"pool": "a100"})]
    out = admit(p, ready_elsewhere)
    assert out["spec"]["schedulingGates"] == [{"name": "weightcache.io/model"}]
    assert "affinity" not in out["spec"], "a gated pod gets its affinity when released"
    again = review(admission_review(out), model_caches=[], allow_undeclared=True, nodes=ready_elsewhere)
    assert "patch" not in again["response"], "re-invocation adds no second gate"


def test_webhook_requires_the_ready_nodes_when_one_the_pod_may_run_on_holds_it() -> None:
    out = admit(deployment_pod({"weightcache.io/model": REF}), [facts("a", {LABEL: "ready"}), facts("b")])
    assert "schedulingGates" not in out["spec"]
    terms = out["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": LABEL, "operator": "In", "values": ["ready"]}]}]


@pytest.mark.parametrize(("placement", "ready", "gated", "kind"), [
    ("prefer", False, False, PREFERRED),
    ("prefer", True, False, PREFERRED),
    ("gate", True, True, None),
    ("require", False, True, None),
])
def test_placement_annotation(placement: str, ready: bool, gated: bool, kind: str | None) -> None:
    nodes = [facts("a", {LABEL: "ready"} if ready else {})]
    out = admit(deployment_pod({"weightcache.io/model": REF, "weightcache.io/placement": placement}), nodes)
    assert bool(out["spec"].get("schedulingGates")) is gated
    assert list((out["spec"].get("affinity") or {}).get("nodeAffinity") or {}) == ([kind] if kind else [])


def test_without_a_view_of_the_nodes_the_webhook_keeps_the_preference() -> None:
    out = admit(deployment_pod({"weightcache.io/model": REF}), None)
    assert "schedulingGates" not in out["spec"] and PREFERRED in out["spec"]["affinity"]["nodeAffinity"]


def test_bad_placement_is_denied_with_what_to_write() -> None:
    p = deployment_pod({"weightcache.io/model": REF, "weightcache.io/placement": "always"})
    answer = review(admission_review(p), model_caches=[], allow_undeclared=True, nodes=[])
    assert not answer["response"]["allowed"]
    assert "weightcache.io/placement: require" in answer["response"]["status"]["message"]
    clash = deployment_pod({"weightcache.io/model": REF, "weightcache.io/placement": "gate",
                            "weightcache.io/require-cached": "false"})
    assert not review(admission_review(clash), model_caches=[], allow_undeclared=True)["response"]["allowed"]


# node choice --------------------------------------------------------------------------------------------------
def gated_pod(name: str, *, gpus: int = 1, created: str = "2026-01-01T00:00:00Z", **spec: Any) -> dict[str, Any]:
    p = pod(schedulingGates=[{"name": choice.GATE}], **spec)
    p["metadata"].update(name=name, creationTimestamp=created)
    p["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": str(gpus)}}
    return p


DEMAND = choice.demand_name(parse_ref(REF))


def test_choice_prefers_holders_then_fetching_then_free_gpus_and_respects_constraints() -> None:
    nodes = [facts("full", {LABEL: "ready"}, gpus=1, used=1), facts("idle", gpus=8), facts("busy", gpus=8, used=6),
             facts("holder", {LABEL: "ready"}, gpus=2), facts("tainted", gpus=8,
                                                            taints=({"key": "k", "effect": "NoSchedule"},))]
    out = choice.plan([gated_pod("p1")], nodes, {})
    assert out.chosen == {"inference/p1": "holder"}, "a node holding the model with room wins"
    out = choice.plan([gated_pod("p1")], [n for n in nodes if n.name != "holder"], {DEMAND: ["busy"]})
    assert out.chosen == {"inference/p1": "busy"}, "a node already fetching wins over an idle one"
    out = choice.plan([gated_pod("p1")], [n for n in nodes if n.name not in ("holder", "full")], {})
    assert out.chosen == {"inference/p1": "idle"} and out.nodes == {DEMAND: {"idle"}}
    two = choice.plan([gated_pod("p1", gpus=8), gated_pod("p2", gpus=8, created="2026-01-01T00:00:01Z")],
                      [facts("a", gpus=8), facts("b", gpus=8)], {})
    assert sorted(two.chosen.values()) == ["a", "b"], "two 8-GPU pods need two nodes fetching"
    nowhere = choice.plan([gated_pod("p1", nodeSelector={"pool": "none"})], nodes, {})
    assert nowhere.chosen == {} and nowhere.nodes == {}


def test_choice_keeps_within_each_nodes_disk_budget() -> None:
    other = choice.demand_name(parse_ref("s3://models/other/"))
    nodes = [facts("small", gpus=8), facts("big", gpus=1)]
    sizes = {DEMAND: 6 * 2**30, other: 3 * 2**30}
    out = choice.plan([gated_pod("p1")], nodes, {other: ["big"]}, budgets={"small": 4 * 2**30, "big": 9 * 2**30},
                      sizes=sizes)
    assert out.chosen == {"inference/p1": "big"}, "6 GiB does not fit a 4 GiB budget; 6 + 3 fits 9"
    full = choice.plan([gated_pod("p1")], nodes, {other: ["big"]}, budgets={"small": 4 * 2**30, "big": 8 * 2**30},
                       sizes=sizes)
    assert full.chosen == {} and not full.nodes.get(DEMAND), "no node has room: nothing is asked"
    holder = [facts("small", {LABEL: "ready"}, gpus=8)]
    assert choice.plan([gated_pod("p1")], holder, {}, budgets={"small": 1}, sizes=sizes).chosen == {
        "inference/p1": "small"}, "a node that holds the model already has room for it"
    unknown = choice.plan([gated_pod("p1")], nodes, {}, budgets={"small": 1})
    assert unknown.chosen == {"inference/p1": "small"}, "an unknown size does not limit"


def test_demand_follows_bound_and_released_pods_and_goes_when_none_need_it() -> None:
    bound = pod(nodeName="n1")
    waiting = pod()  # released, not yet scheduled: keeps the nodes asked so far
    done = pod(nodeName="n2")
    done["status"] = {"phase": "Failed"}
    nodes = [facts("n1"), facts("n2"), facts("n3")]
    assert choice.plan([bound, waiting, done], nodes, {DEMAND: ["n3"]}).nodes == {DEMAND: {"n1", "n3"}}
    assert choice.plan([done], nodes, {DEMAND: ["n3"]}).nodes == {}
    assert choice.plan([bound], [facts("n3")], {}).nodes == {DEMAND: set()}, "a deleted node drops out"


def test_memory_nodes_spread_over_zones_and_keep_previous_picks() -> None:
    zone = "topology.kubernetes.io/zone"
    nodes = [facts(f"{z}-{i}", {zone: z}, gpus=i) for z in ("a", "b", "c") for i in range(3)]
    picked = choice.memory_nodes(nodes, 3, [])
    assert sorted(n[0] for n in picked) == ["a", "b", "c"], picked
    kept = choice.memory_nodes(nodes, 2, ["b-0", "gone"])
    assert "b-0" in kept and kept[0][0] != kept[1][0], "the second pick goes to another zone"
    assert choice.memory_nodes(nodes, 0, ["a-1"]) == [] and len(choice.memory_nodes(nodes, 50, [])) == 9
    assert choice.memory_nodes(nodes, 3, ["a-0", "a-1", "b-0"]) in (["a-0", "b-0", "c-2"], ["a-1", "b-0", "c-2"])
    assert choice.memory_nodes(nodes, 2, ["a-0", "a-1"]) == ["a-0", "b-2"], "a zone seen late gets a pick"
    assert choice.memory_nodes(nodes[:3], 2, ["a-0", "a-1"]) == ["a-0", "a-1"], "one zone only: both stay"
    assert choice.memory_nodes(nodes, 5, ["a-0", "a-1"]) == ["a-0", "a-1", "a-2", "b-2", "c-2"], "room for both"


# the daemon side ----------------------------------------------------------------------------------------------
def test_daemon_reads_node_names_and_memory_nodes() -> None:
    mc = {"metadata": {"name": choice.demand_name(parse_ref(REF))},
          "spec": {"source": REF, "nodeSelector": {}, "nodeNames": ["n1"], "memory": {"nodes": 1}},
          "status": {"memoryNodes": ["n1"]}}
    plain = {"metadata": {"name": "pool"}, "spec": {"source": REF, "nodeSelector": {"pool": "a"}, "tier": "memory",
                                                     "memory": {"nodes": 1}}, "status": {"memoryNodes": ["n9"]}}
    wanted, invalid = desired_plan([mc, plain], {"pool": "a"}, "n1")
    assert invalid == []
    assert {(w.name, w.tier) for w in wanted} == {(mc["metadata"]["name"], "memory"), ("pool", "disk")}
    assert [w.name for w in desired_plan([mc], {}, "n2")[0]] == [], "a node not named is not asked"
    assert desired_plan([mc], {}, None)[0] == [], "without its name a node matches no nodeNames"


async def test_the_webhook_server_passes_its_node_view_to_the_decision() -> None:
    from aiohttp.test_utils import TestClient, TestServer

    from weightcache.webhook.server import Policy, make_app

    views: list[list[NodeFacts] | None] = [None]
    policy = Policy(model_caches=list, allow_undeclared=True, nodes=lambda: views[0])
    async with TestClient(TestServer(make_app(policy))) as client:
        async def gated() -> bool:
            body = admission_review(deployment_pod({"weightcache.io/model": REF}))
            answer = await (await client.post("/mutate", json=body)).json()
            return bool(apply_response(body["request"]["object"], answer)["spec"].get("schedulingGates"))

        assert not await gated(), "no view of the nodes yet: a preference, no gate"
        views[0] = [facts("a")]
        assert await gated(), "nodes known, none holds the model: gated"
        views[0] = [facts("a", {LABEL: "ready"})]
        assert not await gated()
