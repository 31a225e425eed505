"""The daemon with `dra:` configured, in cluster mode against the fake API server: a ModelCache's model becomes
devices in this node's ResourceSlice, kubelet (played with the generated stubs) registers the plugin and prepares
a claim for one of them under the ModelCache's namespace policy, and an eviction takes the devices away."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_daemon import eventually, model_copy, short_dir, start_daemon, tiny_model  # noqa: F401
from tests.fixtures_dra import Kubelet
from tests.test_daemon_cluster import NODE, cluster, model_cache  # noqa: F401
from weightcache.dra import DRIVER_NAME
from weightcache.dra.devices import snapshot_of
from weightcache.dra.server import plugin_socket, registration_socket


def devices(api: FakeApiServer) -> list[dict[str, Any]]:
    return [d for s in api.list("resourceslices") if s["spec"]["nodeName"] == NODE for d in s["spec"]["devices"]]


def allocated(api: FakeApiServer, namespace: str, name: str, device: str) -> dict[str, Any]:
    claim = api.create("resourceclaims", {"metadata": {"name": name}, "spec": {}}, namespace)
    claim["status"] = {"allocation": {"devices": {"results": [
        {"request": "model", "driver": DRIVER_NAME, "pool": NODE, "device": device}]}}}
    return api.update("resourceclaims", name, claim, namespace=namespace, subresource="status")


async def test_daemon_publishes_prepares_and_withdraws_models(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    uri = f"file://{model_copy}/"
    cluster.create("modelcaches", model_cache("llama", uri, "a100", ["ml"]))
    kubelet_dir = short_dir / "k"
    config = {"kubeletDir": str(kubelet_dir),
              "dra": {"slotsPerModel": 2, "cdiDir": str(short_dir / "cdi"), "publishSeconds": 0.2}}
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
