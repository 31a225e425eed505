"""Placement against hostile tenants (issue "Hardening III"): the controller applies the namespace policy, demand
says who asked, one pod's bad annotations cost only that pod, caps on models per pod and per namespace, fair
demand writes, readiness labels that name the selection, and the daemon keeping labels that are not its own.

Each test replays an attack; the API-level ones run the real controller against the fake API server."""

from __future__ import annotations

import time
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer, crd_schemas, model_cache
from tests.fixtures_daemon import wait_until
from tests.fixtures_webhook import REF, admission_review, apply_response, deployment_pod
from tests.test_placement_controller import MERGE, gpu_node, grant
from weightcache.daemon.node import Want
from weightcache.daemon.reconcile import READY, Actual, settle
from weightcache.kube.desired import plan as desired_plan
from weightcache.placement import CONTROLLER, MANAGED_BY, choice
from weightcache.placement.controller import Controller
from weightcache.placement.nodes import NodeFacts, node_facts
from weightcache.pods.annotations import MAX_MODELS
from weightcache.uri import parse_ref
from weightcache.webhook.mutate import review

TENANT, OTHER = "team-a", "team-b"
HOSTILE = "s3://models/a@b/@v1"  # parsed, but its canonical form did not parse again


def pod(name: str, namespace: str, annotations: dict[str, str], **spec: Any) -> dict[str, Any]:
    p = deployment_pod(annotations)
    p["metadata"].pop("generateName", None)
    p["metadata"].update(name=name, namespace=namespace, creationTimestamp=f"2025-01-01T00:00:{len(name):02d}Z")
    p["spec"].update(spec)
    return p


def gated_pod(name: str, namespace: str, annotations: dict[str, str]) -> dict[str, Any]:
    p = pod(name, namespace, annotations)
    p["spec"]["schedulingGates"] = [{"name": choice.GATE}]
    return p


def grants(*pairs: tuple[str, list[str]]) -> list[dict[str, Any]]:
    return [model_cache(f"g{i}", source, allowedNamespaces=namespaces) for i, (source, namespaces) in enumerate(pairs)]


def models(prefix: str, n: int) -> str:
    return ",".join(f"m{i}=s3://models/{prefix}-{i}/" for i in range(n))


# the policy and the caps, as pure functions ---------------------------------------------------------------------
def test_no_demand_for_a_namespace_the_policy_refuses_even_for_a_pod_bound_by_hand() -> None:
    """A tenant sets spec.nodeName itself on a pod naming a model no ModelCache grants it: before, the
    controller demanded it on that node and the daemon fetched and pinned it."""
    allowed = gated_pod("ok", TENANT, {"weightcache.io/model": REF})
    stolen = pod("thief", OTHER, {"weightcache.io/model": REF}, nodeName="gpu-a")
    admission = choice.admit([allowed, stolen], grants((REF, [TENANT])))
    assert admission.pods == [allowed]
    refusal = admission.refused[f"{OTHER}/thief"]
    assert refusal.reason == "NotAllowed" and "allowedNamespaces" in refusal.message
    plan = choice.plan(admission.pods, [NodeFacts("gpu-a", {}, (), False, 1, 0)], {})
    assert plan.namespaces == {choice.demand_name(parse_ref(REF)): {TENANT}}


def test_the_controllers_own_demand_grants_nothing_to_anyone() -> None:
    demand = model_cache(choice.demand_name(parse_ref(REF)), REF, allowedNamespaces=[], nodeNames=["gpu-a"])
    demand["metadata"]["labels"] = {MANAGED_BY: CONTROLLER}
    assert choice.admit([pod("p", TENANT, {"weightcache.io/model": REF}, nodeName="gpu-a")], [demand]).pods == []


def test_a_pod_over_the_model_cap_is_refused_with_what_to_do() -> None:
    """One pod once named 1,501 models and made as many demand ModelCaches."""
    many = MAX_MODELS + 1
    big = gated_pod("big", TENANT, {"weightcache.io/models": models("x", many)})
    admission = choice.admit([big], grants(*((f"s3://models/x-{i}/", [TENANT]) for i in range(many))))
    assert admission.pods == []
    refusal = admission.refused[f"{TENANT}/big"]
    assert refusal.reason == "InvalidAnnotations" and f"at most {MAX_MODELS}" in refusal.message


def test_a_namespace_at_its_demand_cap_keeps_what_runs_and_its_newest_pods_wait() -> None:
    sources = [(f"s3://models/x-{i}/", [TENANT]) for i in range(6)] + [(REF, [OTHER])]
    running = pod("a-running", TENANT, {"weightcache.io/models": models("x", 3)}, nodeName="gpu-a")
    newer = gated_pod("b-newer", TENANT, {"weightcache.io/models": ",".join(
        f"m{i}=s3://models/x-{i}/" for i in range(2, 6))})
    same = gated_pod("c-same", TENANT, {"weightcache.io/models": models("x", 2)})  # already demanded: no new ones
    other = gated_pod("d-other", OTHER, {"weightcache.io/model": REF})
    admission = choice.admit([newer, same, other, running], grants(*sources), per_namespace=4)
    assert [choice.pod_key(p) for p in admission.pods] == [f"{TENANT}/a-running", f"{TENANT}/c-same",
                                                            f"{OTHER}/d-other"]
    refusal = admission.refused[f"{TENANT}/b-newer"]
    assert refusal.reason == "TooManyModels" and "at most 4 per namespace" in refusal.message


def test_an_error_in_one_pod_costs_only_that_pod(monkeypatch: pytest.MonkeyPatch) -> None:
    """A parser bug only a hostile annotation finds (simulated) must not stop the choice for other pods."""
    real = choice.parse_annotations

    def parse(annotations: Any, **options: Any) -> Any:
        if annotations.get("weightcache.io/model") == "s3://models/boom/":
            raise RuntimeError("a bug")
        return real(annotations, **options)

    monkeypatch.setattr(choice, "parse_annotations", parse)
    boom, fine = gated_pod("boom", OTHER, {"weightcache.io/model": "s3://models/boom/"}), \
        gated_pod("fine", TENANT, {"weightcache.io/model": REF})
    admission = choice.admit([boom, fine], grants((REF, [TENANT]), ("s3://models/boom/", [OTHER])))
    assert admission.pods == [fine] and admission.refused[f"{OTHER}/boom"].reason == "InvalidAnnotations"
    plan = choice.plan([boom, fine], [NodeFacts("gpu-a", {}, (), False, 1, 0)], {})
    assert f"{OTHER}/boom" in plan.failed and plan.chosen == {f"{TENANT}/fine": "gpu-a"}


# readiness labels name the selection ----------------------------------------------------------------------------
def test_a_node_holding_only_config_json_is_no_release_target_for_a_full_model_pod() -> None:
    config_only = model_cache("cfg", REF, node_selector={"pool": "gpu"}, include=["config.json"])
    (held,), _ = desired_plan([config_only], {"pool": "gpu"})
    node = NodeFacts("gpu-a", {"pool": "gpu", held.label_key: READY}, (), False, 1, 0)
    full = gated_pod("full", TENANT, {"weightcache.io/model": REF})
    state = choice.pod_state(full)
    assert choice.ready_nodes(full, state.refs, [node]) == [], "required onto a node that lacks its weights"
    config = gated_pod("cfg", TENANT, {"weightcache.io/model": REF, "weightcache.io/include": "config.json"})
    assert choice.ready_nodes(config, choice.pod_state(config).refs, [node]) == ["gpu-a"]
    # the webhook reads the same label: it gates the full-model pod instead of requiring it onto gpu-a
    fresh = deployment_pod({"weightcache.io/model": REF})
    patched = apply_response(fresh, review(admission_review(fresh), model_caches=[], allow_undeclared=True,
                                           nodes=[node_facts(gpu_node("gpu-a", node.labels))]))
    assert patched["spec"].get("schedulingGates") == [{"name": choice.GATE}]


def test_the_daemon_removes_only_its_own_readiness_labels() -> None:
    """Before, every node label starting with weightcache.io/m went, an operator's memory-pool label too."""
    want = Want("a", parse_ref("s3://models/a/"), "disk", True, 0)
    stale = parse_ref("s3://models/gone/").label_key
    labels = {stale: READY, "weightcache.io/memory-pool": "big", "weightcache.io/model-zoo": "x", "zone": "z"}
    out = settle({}, [want], {"a": "snap-a"}, Actual(labels=labels))
    assert out.labels == {want.ref.label_key: READY, stale: None}


# against the API server -----------------------------------------------------------------------------------------
@pytest.fixture
def api(apiserver: FakeApiServer) -> FakeApiServer:
    apiserver.create("nodes", gpu_node("gpu-a"))
    return apiserver


def watching(api: FakeApiServer, **options: Any) -> Controller:
    """A controller that watches but does not loop: each test runs and counts its passes."""
    ctl = Controller(api.api_client(), event_interval=0.0, **options)
    ctl.start(loop=False)
    wait_until(ctl.synced, what="the watches")
    return ctl


def seen(ctl: Controller, pods: int) -> None:
    wait_until(lambda: len(ctl.pods.items()) == pods and len(ctl.nodes.items()) >= 1, what="the pods")


def events(api: FakeApiServer, namespace: str, name: str) -> list[dict[str, Any]]:
    return [e for e in api.list("events", namespace) if e["involvedObject"]["name"] == name]


def create_gated(api: FakeApiServer, name: str, namespace: str, annotations: dict[str, str]) -> dict[str, Any]:
    p = deployment_pod(annotations)
    p["metadata"].update(name=name, namespace=namespace)
    patched = apply_response(p, review(admission_review(p), model_caches=[], allow_undeclared=True,
                                       nodes=[node_facts(n) for n in api.list("nodes")]))
    return api.create("pods", patched, namespace)


def test_one_hostile_annotation_no_longer_halts_placement_cluster_wide(api: FakeApiServer) -> None:
    """A tenant edits its gated pod's annotation after CREATE to one whose canonical form did not parse: the
    error escaped every pass, and no other tenant's pod was ever released."""
    grant(api, "grant", REF, [TENANT])
    create_gated(api, "victim", TENANT, {"weightcache.io/model": REF})
    create_gated(api, "hostile", OTHER, {"weightcache.io/model": "s3://models/x/"})
    api.patch("pods", "hostile", {"metadata": {"annotations": {"weightcache.io/model": HOSTILE}}}, MERGE,
              namespace=OTHER)
    api.patch("nodes", "gpu-a", {"metadata": {"labels": {parse_ref(REF).label_key: READY}}}, MERGE)
    ctl = watching(api)
    try:
        seen(ctl, 2)
        wait_until(lambda: ctl.pods.items()[0]["metadata"]["annotations"].get("weightcache.io/model") == HOSTILE
                   or ctl.pods.items()[1]["metadata"]["annotations"].get("weightcache.io/model") == HOSTILE,
                   what="the edit")
        result = ctl.reconcile()
        assert result.released == (f"{TENANT}/victim",)
        assert not choice.gated(api.get("pods", "victim", TENANT))
        (event,) = events(api, OTHER, "hostile")
        assert event["type"] == "Warning" and event["reason"] == "InvalidAnnotations"
        assert "'@' may appear once" in event["message"]
        assert choice.gated(api.get("pods", "hostile", OTHER)), "a refused pod is not released"
    finally:
        ctl.stop()


def test_demand_names_the_namespaces_that_asked_and_grants_none(api: FakeApiServer) -> None:
    grant(api, "grant", REF, [TENANT, OTHER])
    create_gated(api, "a", TENANT, {"weightcache.io/model": REF})
    create_gated(api, "b", OTHER, {"weightcache.io/model": REF})
    api.create("pods", pod("c", "team-c", {"weightcache.io/model": REF}, nodeName="gpu-a"), "team-c")
    ctl = watching(api)
    try:
        seen(ctl, 3)
        ctl.reconcile()
        demand = api.get("modelcaches", choice.demand_name(parse_ref(REF)))
        assert demand["spec"]["demandNamespaces"] == [TENANT, OTHER], "sorted, one entry each"
        assert demand["spec"]["allowedNamespaces"] == [], "demand grants nothing"
        assert [e["reason"] for e in events(api, "team-c", "c")] == ["NotAllowed"]
        # the field is in the CRD schema: a real API server prunes fields its schema does not name
        spec = crd_schemas()["modelcaches"]["properties"]["spec"]["properties"]
        assert spec["demandNamespaces"]["items"]["pattern"] and spec["demandNamespaces"]["description"]
        (wanted,), _ = desired_plan([demand], {}, "gpu-a")
        assert wanted.namespaces == (TENANT, OTHER)
        api.delete("pods", "b", OTHER)
        wait_until(lambda: len(ctl.pods.items()) == 2, what="the delete")
        ctl.reconcile()
        assert api.get("modelcaches", demand["metadata"]["name"])["spec"]["demandNamespaces"] == [TENANT]
    finally:
        ctl.stop()


def test_one_tenants_many_models_do_not_delay_another_tenants_demand(api: FakeApiServer) -> None:
    """Demand writes are bounded per pass and taken round-robin over namespaces: another tenant's one model goes
    out in the first pass however many the first tenant asks for, and the first tenant stops at its cap."""
    for i in range(12):
        grant(api, f"g{i}", f"s3://models/x-{i}/", [TENANT])
    grant(api, "other", REF, [OTHER])
    for j in range(3):
        create_gated(api, f"p{j}", TENANT, {"weightcache.io/models": ",".join(
            f"m{i}=s3://models/x-{i}/" for i in range(4 * j, 4 * j + 4))})
    create_gated(api, "z-other", OTHER, {"weightcache.io/model": REF})
    ctl = watching(api, max_writes=3, max_demand_per_namespace=8)
    try:
        seen(ctl, 4)
        first = ctl.reconcile()
        mine = choice.demand_name(parse_ref(REF))
        names = [m["metadata"]["name"] for m in api.list("modelcaches")
                 if m["metadata"]["name"].startswith("placement-")]
        assert mine in names and len(names) == 3, names
        assert first.pending == 6 and first.refused[f"{TENANT}/p2"].reason == "TooManyModels"
        deadline = time.monotonic() + 10
        while ctl.reconcile().pending and time.monotonic() < deadline:
            pass
        names = [m for m in api.list("modelcaches") if m["metadata"]["name"].startswith("placement-")]
        assert len(names) == 9, "8 for the first tenant (its cap), 1 for the other"
        (event,) = events(api, TENANT, "p2")
        assert event["reason"] == "TooManyModels" and event["type"] == "Warning"
    finally:
        ctl.stop()
