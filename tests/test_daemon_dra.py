"""The daemon with `dra:` configured, in cluster mode against the fake API server: a ModelCache's model becomes
devices in this node's ResourceSlice, kubelet (played with the generated stubs) registers the plugin and prepares
a claim for one of them under the ModelCache's namespace policy, and an eviction takes the devices away."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from tests.fake_apiserver import FakeApiServer
from tests.fake_rules import daemon_user, shipped_rbac
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_dra import Kubelet
from tests.fixtures_kube import NODE
from tests.test_daemon_cluster import model_cache
from weightcache.dra import DRIVER_NAME
from weightcache.dra.devices import snapshot_of
from weightcache.dra.fetchable import MODEL_READY, SIZE_ANNOTATION, device_name
from weightcache.dra.server import plugin_socket, registration_socket
from weightcache.uri import model_key, parse_ref


def devices(api: FakeApiServer) -> list[dict[str, Any]]:
    return [d for s in api.list("resourceslices") if s["spec"]["nodeName"] == NODE
            for d in s["spec"].get("devices", [])]


def allocated(api: FakeApiServer, namespace: str, name: str, device: str) -> dict[str, Any]:
    claim = api.create("resourceclaims", {"metadata": {"name": name}, "spec": {}}, namespace)
    claim["status"] = {"allocation": {"devices": {"results": [
        {"request": "model", "driver": DRIVER_NAME, "pool": NODE, "device": device}]}}}
    return api.update("resourceclaims", name, claim, namespace=namespace, subresource="status")


def _dra_config(cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> dict[str, Any]:
    """A ModelCache of the model for namespace ml, and a daemon config with DRA on (kubelet dir short_dir/k)."""
    cluster.create("modelcaches", model_cache("llama", f"file://{model_copy}/", "a100", ["ml"]))
    return {"kubeletDir": str(short_dir / "k"),
            "dra": {"slotsPerModel": 2, "cdiDir": str(short_dir / "cdi"), "publishSeconds": 0.2}}


async def test_daemon_publishes_prepares_and_withdraws_models(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    config = _dra_config(cluster, short_dir, model_copy)
    kubelet_dir = short_dir / "k"
    d = await start_daemon(short_dir, model_copy, config=config, env={"NODE_NAME": NODE})
    kubelet = Kubelet(kubelet_dir)
    try:
        assert registration_socket(kubelet_dir).is_socket() and plugin_socket(kubelet_dir).is_socket()
        await eventually(lambda: len(devices(cluster)) == 2, what="the model's two devices in the ResourceSlice")
        (info,) = d.daemon.node.store.list()
        assert {snapshot_of(x["name"]) for x in devices(cluster)} == {info.snapshot.id}

        await kubelet.register()
        ok = allocated(cluster, "ml", "c1", f"m-{info.snapshot.id}-1")
        refused = allocated(cluster, "other", "c2", f"m-{info.snapshot.id}-0")
        answer = (await kubelet.prepare(ok, refused)).claims
        assert answer[ok["metadata"]["uid"]].error == ""
        assert "allowedNamespaces" in answer[refused["metadata"]["uid"]].error
        assert (short_dir / "cdi" / f"{DRIVER_NAME}-{ok['metadata']['uid']}.json").is_file()
        assert (await kubelet.unprepare(ok)).claims[ok["metadata"]["uid"]].error == ""

        cluster.delete("modelcaches", "llama")
        await eventually(lambda: not d.daemon.node.store.pins(info.snapshot.id), what="the pin to go")
        d.daemon.node.store.evict(info.snapshot.id)
        await eventually(lambda: devices(cluster) == [], what="the evicted model's devices to go")
    finally:
        await kubelet.close()
        await d.daemon.stop()
    assert not registration_socket(kubelet_dir).exists() and not plugin_socket(kubelet_dir).exists()


async def test_on_1_36_the_daemon_offers_a_fetchable_device_and_marks_its_claim_model_ready(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    """The 1.36 path end to end in the daemon: GET /version says 1.36, so a declared, sized model nobody fetched yet
    is a device with the model-ready binding condition; the scheduler's allocation (played here) makes the daemon
    fetch it under the claim's namespace and set the condition on the claim. The daemon runs with its node-bound
    ServiceAccount token under the shipped RBAC (deploy/daemonset and deploy/dra), and is refused nothing."""
    cluster.version = ("1", "36")
    cluster.token_for(daemon_user(NODE), "test-token")
    cluster.rbac = shipped_rbac()
    uri = f"file://{model_copy}/"
    size = sum(p.stat().st_size for p in model_copy.rglob("*") if p.is_file())
    cluster.create("modelcaches", {"metadata": {"name": "offered", "annotations": {SIZE_ANNOTATION: str(size)}},
                                   "spec": {"source": uri, "allowedNamespaces": ["ml"]}})
    config = {"kubeletDir": str(short_dir / "k"),
              "dra": {"cdiDir": str(short_dir / "cdi"), "publishSeconds": 0.2}}
    d = await start_daemon(short_dir, model_copy, config=config, env={"NODE_NAME": NODE})
    try:
        name = device_name(model_key(parse_ref(uri).uri))
        (device,) = await eventually(lambda: [x for x in devices(cluster) if x["name"] == name],
                                     what="the fetchable device in the slice")
        assert device["bindingConditions"] == [MODEL_READY] and d.daemon.node.store.list() == []
        started = time.monotonic()
        claim = cluster.create("resourceclaims", {"metadata": {"name": "c1"}, "spec": {}}, "ml")
        claim["status"] = {"allocation": {"devices": {"results": [  # the scheduler copies the device's conditions
            {"request": "model", "driver": DRIVER_NAME, "pool": NODE, "device": name,
             "bindingConditions": device["bindingConditions"],
             "bindingFailureConditions": device["bindingFailureConditions"]}]},
            "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [  # a node-local pool: the node is named
                {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]}}}
        cluster.update("resourceclaims", "c1", claim, namespace="ml", subresource="status")

        def ready() -> bool:
            status = cluster.get("resourceclaims", "c1", "ml").get("status", {})
            return any(c.get("type") == MODEL_READY and c.get("status") == "True"
                       for dev in status.get("devices", []) for c in dev.get("conditions", []))
        await eventually(ready, timeout=30, what="model-ready on the claim")
        print(f"allocated -> model-ready in {time.monotonic() - started:.2f}s")
        assert [i.snapshot.uri for i in d.daemon.node.store.list()] == [uri]
        # held now, and on 1.36 (dra.shared: auto) as one shared device with consumable readers, not 8 slots
        sid = d.daemon.node.store.list()[0].snapshot.id
        (shared,) = await eventually(lambda: [x for x in devices(cluster) if snapshot_of(x["name"]) == sid],
                                     what="the held model's shared device")
        assert shared["name"] == f"m-{sid}" and shared["allowMultipleAllocations"] is True
        assert shared["capacity"] == {"readers": {"value": "8", "requestPolicy": {"default": "1",
                                                                                   "validValues": ["1"]}}}
        assert cluster.forbidden == []
    finally:
        await d.daemon.stop()


async def test_a_server_that_drops_the_136_fields_gets_slots_and_no_fetchable_devices(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    """1.36 by /version, but with DRAConsumableCapacity and DRADeviceBindingConditions off: the API server stores
    the slice without allowMultipleAllocations, the capacity's requestPolicy and the binding conditions. The daemon
    sees it in what the server stored and publishes slot devices and no fetchable device."""
    cluster.version = ("1", "36")

    def gates_off(obj: dict[str, Any]) -> None:
        for device in obj["spec"].get("devices", []):
            for field in ("allowMultipleAllocations", "bindingConditions", "bindingFailureConditions"):
                device.pop(field, None)
            for capacity in (device.get("capacity") or {}).values():
                capacity.pop("requestPolicy", None)
    cluster.on_store["resourceslices"] = gates_off
    uri = f"file://{model_copy}/"
    cluster.create("modelcaches", model_cache("llama", uri, "a100", ["ml"]))
    offered = model_cache("elsewhere", f"file://{short_dir}/nope/", "h100", ["ml"])
    offered["metadata"]["annotations"] = {SIZE_ANNOTATION: "1000"}
    cluster.create("modelcaches", offered)
    config = {"kubeletDir": str(short_dir / "k"),
              "dra": {"slotsPerModel": 2, "cdiDir": str(short_dir / "cdi"), "publishSeconds": 0.1}}
    d = await start_daemon(short_dir, model_copy, config=config, env={"NODE_NAME": NODE})
    try:
        def slots() -> list[str]:
            names = sorted(x["name"] for x in devices(cluster))
            held = [i.snapshot.id for i in d.daemon.node.store.list()]
            return names if held and names == [f"m-{held[0]}-0", f"m-{held[0]}-1"] else []
        await eventually(slots, timeout=30, what="slot devices only, after the server dropped the shared fields")
        assert not any(s["spec"].get("sharedCounters") for s in cluster.list("resourceslices"))
    finally:
        await d.daemon.stop()


async def test_a_claim_record_of_a_newer_release_keeps_its_leases_across_restarts(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    """Hardening IV: a claim record written by a newer release (a field this one does not know, in a device) was
    quarantined by the older daemon, whose next start released the claim's leases while its pod still ran. Now a
    newer minor's record is read with its unknown fields kept, a newer major's left alone: two restarts later
    both claims still hold their leases, and kubelet's unprepare of the readable one releases it."""
    config = _dra_config(cluster, short_dir, model_copy)
    kubelet_dir = short_dir / "k"
    d = await start_daemon(short_dir, model_copy, config=config, env={"NODE_NAME": NODE})
    kubelet = Kubelet(kubelet_dir)
    try:
        await eventually(lambda: len(devices(cluster)) == 2, what="the model's two devices in the ResourceSlice")
        (info,) = d.daemon.node.store.list()
        await kubelet.register()
        claims = [allocated(cluster, "ml", f"c{i}", f"m-{info.snapshot.id}-{i}") for i in (0, 1)]
        answer = (await kubelet.prepare(*claims)).claims
        assert all(answer[c["metadata"]["uid"]].error == "" for c in claims)
        leases = d.daemon.node.store.leases()
        assert len(leases) == 2
    finally:
        await kubelet.close()
        await d.daemon.stop()
    records = short_dir / "root" / "dra" / "claims"
    for claim, version in zip(claims, ("1.3", "2.0"), strict=True):  # a newer minor, a newer major
        path = records / f"{claim['metadata']['uid']}.json"
        record = json.loads(path.read_text())
        record["devices"][0]["numa_node"] = "1"  # what a later release might add, in a device and at the top
        path.write_text(json.dumps({**record, "version": version, "checkpoint": {"generation": 7}}))
    written = {c["metadata"]["uid"]: (records / f"{c['metadata']['uid']}.json").read_bytes() for c in claims}

    for _ in range(2):  # the rolled-back daemon starts, and starts again
        d = await start_daemon(short_dir, model_copy, config=config, env={"NODE_NAME": NODE})
        try:
            assert d.daemon.node.store.leases() == leases, "a running pod's claim lost its lease"
        finally:
            await d.daemon.stop()
        assert {uid: (records / f"{uid}.json").read_bytes() for uid in written} == written
    d = await start_daemon(short_dir, model_copy, config=config, env={"NODE_NAME": NODE})
    kubelet = Kubelet(kubelet_dir)
    try:
        await kubelet.register()
        newer = (await kubelet.unprepare(claims[1])).claims[claims[1]["metadata"]["uid"]].error
        assert "written by a newer weightcache (record version 2.0" in newer
        assert (await kubelet.unprepare(claims[0])).claims[claims[0]["metadata"]["uid"]].error == ""
        assert set(d.daemon.node.store.leases()) == {h for h in leases if claims[1]["metadata"]["uid"] in h}
    finally:
        await kubelet.close()
        await d.daemon.stop()
