"""Device taints: a held copy being evicted, re-verified or found damaged stays in the slice, tainted
`weightcache.io/unavailable=<state>`, until whole again; the slices validate against the official 1.37 schema
(strict; taints are stable there) and the publisher writes the change at its next tick through its change token."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fake_rules import daemon_user, shipped_rbac
from tests.fixtures_daemon import RunningDaemon
from tests.fixtures_dra import ALLOWED_NS, NODE, DraHarness, fetch_models
from tests.test_dra_slices import check_slice, slices_of
from weightcache.dra.claims import ClaimBook
from weightcache.dra.devices import TAINT_KEY, devices_for, snapshot_of
from weightcache.dra.eviction import ExtendedPodEvictor, tolerated_until
from weightcache.dra.slices import SlicePublisher, build_slices
from weightcache.dra.states import DAMAGED, EVICTING, VERIFYING, DeviceStates
from weightcache.store import Snapshot, Store


def test_states_mark_clear_and_keep_damage_found_inside_a_verify() -> None:
    states = DeviceStates()
    with states.marking("a" * 40, VERIFYING):
        assert states.snapshot()["a" * 40].state == VERIFYING
    assert states.snapshot() == {} and states.version == 2
    with states.marking("a" * 40, VERIFYING):
        states.mark("a" * 40, DAMAGED)  # the verify found damage: that outlives the block
    assert states.snapshot()["a" * 40].state == DAMAGED
    before = states.version
    states.mark("a" * 40, DAMAGED)
    assert states.version == before  # unchanged: no new timeAdded, no rewrite
    with pytest.raises(ValueError, match="not one of"):
        states.mark("a" * 40, "gone")


def test_tainted_devices_validate_against_1_37_and_only_damage_is_noexecute(tmp_path: Path) -> None:
    states = DeviceStates()
    snaps = [Snapshot(f"{i:040x}", tmp_path, f"s3://models/m{i}/", None, 10) for i in range(4)]
    for snap, state in zip(snaps, (EVICTING, VERIFYING, DAMAGED), strict=False):
        states.mark(snap.id, state)
    for shared in (False, True):
        devices = devices_for(snaps, slots=2, shared=shared, states=states.snapshot())
        taints = {snapshot_of(d["name"]): d.get("taints") for d in devices}
        assert taints[snaps[3].id] is None  # whole: untainted
        for snap, state, effect in ((snaps[0], EVICTING, "NoSchedule"), (snaps[1], VERIFYING, "NoSchedule"),
                                    (snaps[2], DAMAGED, "NoExecute")):
            (t,) = taints[snap.id]
            assert (t["key"], t["value"], t["effect"]) == (TAINT_KEY, state, effect)
            assert t["timeAdded"].endswith("Z")
        for obj in build_slices(NODE, devices, 1):
            check_slice(obj, "1.37")


def test_a_tainted_pool_holds_64_devices_per_slice(tmp_path: Path) -> None:
    snaps = [Snapshot(f"{i:040x}", tmp_path, f"s3://models/m{i}/", None, 10) for i in range(20)]
    states = DeviceStates()
    states.mark(snaps[0].id, VERIFYING)
    slices = build_slices(NODE, devices_for(snaps, slots=8, shared=False, states=states.snapshot()), 1)
    assert [len(s["spec"]["devices"]) for s in slices] == [64, 64, 32]
    for s in slices:
        check_slice(s, "1.37")


def test_the_publisher_taints_and_untaints_at_its_next_tick(tmp_path: Path, apiserver: FakeApiServer) -> None:
    store = Store(tmp_path / "store")
    (a,) = fetch_models(store, tmp_path / "src", 1)
    states = DeviceStates()

    def devices() -> list[dict[str, Any]]:
        return devices_for([i.snapshot for i in store.list()], slots=2, shared=False, states=states.snapshot())
    layout = store.layout
    pub = SlicePublisher(apiserver.api_client(), NODE, devices, change_token=lambda: (
        layout.snapshots.stat().st_mtime_ns, layout.manifests.stat().st_mtime_ns, states.version))
    assert pub.sync() is True
    with states.marking(a.id, VERIFYING):
        assert pub.sync() is True
        [tainted] = slices_of(apiserver)
        check_slice(tainted, "1.37")
        assert {t["value"] for d in tainted["spec"]["devices"] for t in d["taints"]} == {VERIFYING}
        assert pub.sync(full=True) is False  # timeAdded is ours and stable: a resync rewrites nothing
    assert pub.sync() is True
    [whole] = slices_of(apiserver)
    assert not any("taints" in d for d in whole["spec"]["devices"])
    assert whole["spec"]["pool"]["generation"] == 3


async def test_the_apis_verify_marks_a_damaged_copy_and_its_repair_clears_it(daemon: RunningDaemon) -> None:
    """The daemon's verify route is where damage is found: the copy is marked DAMAGED (its devices tainted
    NoExecute at the publisher's next tick) until a repair makes it whole."""
    snap = await asyncio.to_thread(d_ensure, daemon)
    sid = snap["id"]
    assert daemon.daemon.node is not None
    states = daemon.daemon.node.device_states
    victim = next(p for p in Path(snap["path"]).rglob("*.safetensors"))
    os.chmod(victim, 0o644)
    with open(victim, "r+b") as f:
        f.seek(100)
        f.write(b"\xff" * 8)
    async with daemon.http() as http:
        async with http.post(f"/v1/models/{sid}/verify", json={"repair": False}) as r:
            assert r.status == 200 and (await r.json())["damaged"], await r.text()
        assert states.snapshot()[sid].state == DAMAGED
        async with http.post(f"/v1/models/{sid}/verify", json={"repair": True}) as r:
            assert r.status == 200 and (await r.json())["repaired"], await r.text()
    assert sid not in states.snapshot(), "a repaired copy is whole again: untainted"


async def test_a_failed_repair_leaves_no_damaged_mark_for_the_next_copy(daemon: RunningDaemon) -> None:
    """A repair whose refetch fails has still removed the damaged copy: its mark goes with it, so the same
    snapshot fetched again later (same files, same id) is published untainted, not evicting the pods that get it."""
    snap = await asyncio.to_thread(d_ensure, daemon)
    sid = snap["id"]
    assert daemon.daemon.node is not None
    states = daemon.daemon.node.device_states
    victim = Path(snap["path"]) / "config.json"
    os.chmod(victim, 0o644)
    victim.write_text('{"damaged": true}\n')
    away = daemon.model_dir.with_name("moved")
    daemon.model_dir.rename(away)  # the source is gone: the refetch fails
    async with daemon.http() as http, http.post(f"/v1/models/{sid}/verify", json={"repair": True}) as r:
        assert r.status >= 400 and "no longer cached" in (await r.json())["message"], await r.text()
    assert sid not in states.snapshot(), "the damaged copy is gone: nothing left to taint"
    away.rename(daemon.model_dir)
    assert (await asyncio.to_thread(d_ensure, daemon))["id"] == sid
    assert sid not in states.snapshot()


def d_ensure(daemon: RunningDaemon) -> dict[str, Any]:
    answer = daemon.client.ensure(daemon.model_uri)
    return dict(answer.get("snapshot", answer))


async def test_a_damaged_copy_evicts_the_pods_that_got_it_as_an_extended_resource(dra: DraHarness) -> None:
    """kube-controller-manager evicts pods whose claims are in `spec.resourceClaims`; the daemon deals with the
    pods whose claim the scheduler made for a DRA extended resource (`status.extendedResourceClaimStatus`): it
    deletes them, with its own node-bound token and the shipped RBAC, unless the allocation tolerates the taint."""
    snap = dra.snapshots[0]
    resource = "models.weightcache.io/m1"
    await dra.kubelet.register()
    claims = {}
    for i, (name, toleration) in enumerate((("c-ext", None), ("c-spec", None), ("c-tol", {
            "key": TAINT_KEY, "operator": "Equal", "value": DAMAGED, "effect": "NoExecute"}))):
        result = {**dra.device(snap, i), **({"tolerations": [toleration]} if toleration else {})}
        claims[name] = dra.allocate(ALLOWED_NS, name, [result])
        assert (await dra.kubelet.prepare(claims[name])).claims[claims[name]["metadata"]["uid"]].error == ""
    pods = {}
    for pod_name, claim_name, extended in (("p-ext", "c-ext", True), ("p-spec", "c-spec", False),
                                           ("p-tol", "c-tol", True)):
        one = {resource: "1"}
        container = {"name": "vllm", "image": "vllm", "resources": {"requests": one, "limits": one}}
        spec: dict[str, Any] = {"nodeName": NODE, "containers": [container]}
        if not extended:
            spec["resourceClaims"] = [{"name": "model", "resourceClaimName": claim_name}]
        pod = dra.api.create("pods", {"metadata": {"name": pod_name}, "spec": spec}, ALLOWED_NS)
        if extended:  # what the scheduler records for the claim it made
            pod["status"] = {"extendedResourceClaimStatus": {"resourceClaimName": claim_name, "requestMappings": [
                {"containerName": "vllm", "resourceName": resource, "requestName": "container-0-request-0"}]}}
            pod = dra.api.update("pods", pod_name, pod, namespace=ALLOWED_NS, subresource="status")
        claim = dra.api.get("resourceclaims", claim_name, ALLOWED_NS)
        claim["status"]["reservedFor"] = [{"resource": "pods", "name": pod_name, "uid": pod["metadata"]["uid"]}]
        dra.api.update("resourceclaims", claim_name, claim, namespace=ALLOWED_NS, subresource="status")
        pods[pod_name] = pod

    dra.api.rbac = shipped_rbac()
    states = DeviceStates()
    evictor = ExtendedPodEvictor(dra.api.api_client(dra.api.token_for(daemon_user(NODE))),
                                 book=ClaimBook(dra.store.layout.tree), states=states.snapshot)
    assert await asyncio.to_thread(evictor.sweep) == []  # whole: nobody goes
    states.mark(snap.id, DAMAGED)
    assert await asyncio.to_thread(evictor.sweep) == [f"{ALLOWED_NS}/p-ext"]
    assert {p["metadata"]["name"] for p in dra.api.list("pods", ALLOWED_NS)} == {"p-spec", "p-tol"}
    assert await asyncio.to_thread(evictor.sweep) == []  # gone: nothing more to do


def test_a_toleration_with_seconds_delays_the_eviction() -> None:
    result = {"tolerations": [{"key": TAINT_KEY, "operator": "Exists", "effect": "NoExecute",
                               "tolerationSeconds": 300}]}
    assert tolerated_until(result, "2026-01-01T00:00:00Z") == 1767225600 + 300
    assert tolerated_until({"tolerations": [{"key": TAINT_KEY, "value": VERIFYING, "effect": "NoExecute"}]},
                           "2026-01-01T00:00:00Z") is None
    assert tolerated_until({}, "2026-01-01T00:00:00Z") is None
