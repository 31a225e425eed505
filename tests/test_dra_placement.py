"""The placement controller releases a gated `weightcache.io/via: dra` pod only when the node's ResourceSlice lists
a device of the model: a readiness label alone is not enough (the scheduler would find no device to allocate and
the pod would fail scheduling). Against the fake API server with the real client and watches; the slice is the one
weightcache.dra.slices writes."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_daemon import wait_until
from tests.fixtures_webhook import REF, admission_review, apply_response, deployment_pod
from tests.test_placement_controller import NS, gated, gpu_node, grant, set_label, settle
from weightcache.dra.devices import devices_for
from weightcache.dra.slices import build_slices
from weightcache.placement import choice
from weightcache.placement.controller import Controller
from weightcache.placement.nodes import node_facts
from weightcache.store import Snapshot
from weightcache.uri import parse_ref
from weightcache.webhook.mutate import review


@pytest.fixture
def api(apiserver: FakeApiServer) -> FakeApiServer:
    grant(apiserver, "grant-llama", REF, [NS])
    return apiserver


def dra_pod(api: FakeApiServer, name: str) -> None:
    pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra", "weightcache.io/placement": "gate"})
    pod["metadata"]["name"] = name
    pod["spec"]["containers"][0]["resources"] = {"limits": {"nvidia.com/gpu": "1"}}
    nodes = [node_facts(n) for n in api.list("nodes")]
    patched = apply_response(pod, review(admission_review(pod), model_caches=[], allow_undeclared=True, nodes=nodes))
    assert patched["spec"]["schedulingGates"] == [{"name": choice.GATE}] and patched["spec"]["resourceClaims"]
    api.create("pods", patched, NS)


def publish(api: FakeApiServer, node: str, uri: str, tmp_path: Path) -> None:
    snap = Snapshot("a" * 40, tmp_path, uri, None, 10)
    for obj in build_slices(node, devices_for([snap], slots=2, shared=False), 1):
        api.create("resourceslices", obj)


def test_a_dra_pod_waits_for_the_nodes_slice_to_list_the_model(api: FakeApiServer, tmp_path: Path) -> None:
    api.create("nodes", gpu_node("gpu-a"))
    ctl = Controller(api.api_client(), event_interval=0.5, resync=0.1)
    ctl.start()
    try:
        dra_pod(api, "llama-0")
        set_label(api, "gpu-a", "ready")  # the daemon labels the node as soon as the fetch is done...
        publish(api, "gpu-a", "s3://models/other/", tmp_path)  # ...and a slice of another model is no help
        settle(ctl, 5)
        assert gated(api, "llama-0"), "released before the node's ResourceSlice listed the model's device"
        start = time.perf_counter()
        publish(api, "gpu-b-unrelated", parse_ref(REF).uri, tmp_path / "b")  # another node's slice neither
        api.delete("resourceslices", "gpu-a-models.weightcache.io-0")
        publish(api, "gpu-a", parse_ref(REF).uri, tmp_path)
        wait_until(lambda: not gated(api, "llama-0"), what="the pod released", every=0.02)
        print(f"released {1000 * (time.perf_counter() - start):.0f} ms after the slice listed the model")
    finally:
        ctl.stop()


def test_slice_models_reads_held_devices_only(tmp_path: Path) -> None:
    ref = parse_ref(REF)
    held = devices_for([Snapshot("b" * 40, tmp_path, ref.uri, "r1", 1)], slots=1, shared=False)
    fetchable = [{**held[0], "name": "x", "bindingConditions": ["weightcache.io/model-ready"],
                  "attributes": {**held[0]["attributes"], "ready": {"bool": False}}}]
    models = choice.slice_models([*build_slices("n1", held, 1), *build_slices("n2", fetchable, 1),
                                  {"spec": {"driver": "other", "nodeName": "n3", "devices": held}}],
                                 "models.weightcache.io")
    assert choice.dra_ready_nodes(["n1", "n2", "n3"], [ref], models) == ["n1"]
    assert choice.dra_ready_nodes(["n1"], [parse_ref(REF, revision="r2")], models) == []
    assert choice.dra_ready_nodes(["n1"], [parse_ref(REF, revision="r1")], models) == ["n1"]
