"""DRA fixtures: a node store holding real snapshots, the fake API server with ResourceClaims, the DRA plugin
serving on Unix sockets, and a `Kubelet` that calls it the way kubelet does (registration, then the DRA service
through the endpoint GetInfo names) with the generated stubs.

    async def test_x(dra: DraHarness):
        claim = dra.allocate("ml", "c1", [dra.device(dra.snapshots[0])])
        answer = await dra.kubelet.prepare(claim)
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import celpy
import grpc
import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_crd_cel import cel_eval
from tests.grants import granted
from tests.sample import make_model
from weightcache.access import Authority
from weightcache.dra import DRIVER_NAME
from weightcache.dra._pb import (
    dra_v1_pb2,
    dra_v1_pb2_grpc,
    dra_v1beta1_pb2,
    dra_v1beta1_pb2_grpc,
    pluginregistration_pb2,
    pluginregistration_pb2_grpc,
)
from weightcache.dra.devices import device_name
from weightcache.dra.server import DraPlugin, claim_reader, registration_socket, serve_dra
from weightcache.fetch import Fetcher
from weightcache.store import Snapshot, Store

NODE = "node-1"
ALLOWED_NS = "ml"


def fetch_models(store: Store, src: Path, count: int) -> list[Snapshot]:
    """`count` small real models fetched into the store from file:// sources."""
    snapshots = []
    for i in range(count):
        make_model(src / f"model-{i}", layers=1, hidden=32, seed=i + 1)
        snapshots.append(Fetcher(store, chunk_size=64 << 10).ensure(granted(f"file://{src}/model-{i}/")))
    return snapshots


def namespace_policy(allowed: str, store: Store) -> Authority:
    """In cluster: a ModelCache for each model in `store` granting it to `allowed`, nothing undeclared."""
    def caches() -> list[dict[str, Any]]:
        return [{"metadata": {"name": f"mc-{i}"}, "spec": {"source": info.snapshot.uri, "allowedNamespaces": [allowed]}}
                for i, info in enumerate(store.list())]
    return Authority(model_caches=caches, allow_undeclared=lambda: False)


class Kubelet:
    """kubelet's side: the plugin watcher's registration calls, then the DRA calls on the named endpoint."""

    def __init__(self, kubelet_dir: Path) -> None:
        self.kubelet_dir = kubelet_dir
        self._channels: list[grpc.aio.Channel] = []
        self.endpoint = ""

    def _channel(self, path: str) -> grpc.aio.Channel:
        channel = grpc.aio.insecure_channel(f"unix://{path}")
        self._channels.append(channel)
        return channel

    async def register(self, ok: bool = True, error: str = "") -> pluginregistration_pb2.PluginInfo:
        stub = pluginregistration_pb2_grpc.RegistrationStub(self._channel(str(registration_socket(self.kubelet_dir))))
        info = await stub.GetInfo(pluginregistration_pb2.InfoRequest())
        self.endpoint = info.endpoint
        await stub.NotifyRegistrationStatus(pluginregistration_pb2.RegistrationStatus(plugin_registered=ok,
                                                                                      error=error))
        return info

    async def prepare(self, *claims: dict[str, Any]) -> dra_v1_pb2.NodePrepareResourcesResponse:
        stub = dra_v1_pb2_grpc.DRAPluginStub(self._channel(self.endpoint))
        return await stub.NodePrepareResources(dra_v1_pb2.NodePrepareResourcesRequest(
            claims=[_claim(c, dra_v1_pb2) for c in claims]), timeout=30)

    async def unprepare(self, *claims: dict[str, Any]) -> dra_v1_pb2.NodeUnprepareResourcesResponse:
        stub = dra_v1_pb2_grpc.DRAPluginStub(self._channel(self.endpoint))
        return await stub.NodeUnprepareResources(dra_v1_pb2.NodeUnprepareResourcesRequest(
            claims=[_claim(c, dra_v1_pb2) for c in claims]), timeout=30)

    async def prepare_v1beta1(self, *claims: dict[str, Any]) -> dra_v1beta1_pb2.NodePrepareResourcesResponse:
        stub = dra_v1beta1_pb2_grpc.DRAPluginStub(self._channel(self.endpoint))
        return await stub.NodePrepareResources(dra_v1beta1_pb2.NodePrepareResourcesRequest(
            claims=[_claim(c, dra_v1beta1_pb2) for c in claims]), timeout=30)

    async def close(self) -> None:
        for channel in self._channels:
            await channel.close()


def _claim(obj: dict[str, Any], module: Any) -> Any:
    meta = obj["metadata"]
    return module.Claim(namespace=meta["namespace"], uid=meta["uid"], name=meta["name"])


@dataclass
class DraHarness:
    root: Path
    store: Store
    api: FakeApiServer
    snapshots: list[Snapshot]
    plugin: DraPlugin
    kubelet: Kubelet
    policy: Any = field(default=None)

    @property
    def kubelet_dir(self) -> Path:
        return self.root / "kubelet"

    @property
    def cdi_dir(self) -> Path:
        return self.root / "cdi"

    @staticmethod
    def device(snapshot: Snapshot, slot: int = 0, *, request: str = "model", pool: str = NODE) -> dict[str, str]:
        return {"request": request, "driver": DRIVER_NAME, "pool": pool, "device": device_name(snapshot.id, slot)}

    def allocate(self, namespace: str, name: str, results: list[dict[str, str]],
                 config: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        """A ResourceClaim as the scheduler leaves it: created, then status.allocation written."""
        claim = self.api.create("resourceclaims", {"metadata": {"name": name}, "spec": {"devices": {"requests": [
            {"name": "model", "exactly": {"deviceClassName": DRIVER_NAME}}]}}}, namespace)
        claim["status"] = {"allocation": {"devices": {"results": results, "config": config or []}}}
        return self.api.update("resourceclaims", name, claim, namespace=namespace, subresource="status")

    async def restart(self) -> None:
        """Stop the plugin and start a new one on the same store (a daemon restart)."""
        await self.plugin.stop(0)
        self.plugin = await start_plugin(self.root, self.store, self.api, self.policy)


async def start_plugin(root: Path, store: Store, api: FakeApiServer, policy: Any) -> DraPlugin:
    return await serve_dra(store=store, pool=NODE, kubelet_dir=root / "kubelet", cdi_dir=root / "cdi",
                           authority=policy, claims=claim_reader(api.api_client()), health_interval=0.1)


@pytest.fixture
async def dra(apiserver: FakeApiServer) -> AsyncIterator[DraHarness]:
    tmp_path = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))  # Unix socket paths are limited to 107 bytes
    store = Store(tmp_path / "store")
    snapshots = fetch_models(store, tmp_path / "src", 2)
    policy = namespace_policy(ALLOWED_NS, store)
    plugin = await start_plugin(tmp_path, store, apiserver, policy)
    kubelet = Kubelet(tmp_path / "kubelet")
    harness = DraHarness(tmp_path, store, apiserver, snapshots, plugin, kubelet, policy)
    try:
        yield harness
    finally:
        await kubelet.close()
        await harness.plugin.stop(0)
        store.close()
        shutil.rmtree(tmp_path, ignore_errors=True)


def selected(expressions: list[str], device: dict[str, Any] | Any) -> bool:
    """As the scheduler's structured allocator (k8s.io/dynamic-resource-allocation/structured) evaluates one
    request's selectors on one device: ANDed in order. A result that is not a bool (a CEL runtime error, such as
    reading an attribute the device does not publish) is no mismatch there: it aborts the allocation of the whole
    claim ("CEL runtime error during evaluation of selector"), so here it fails the test."""
    cel = device if isinstance(device, celpy.celtypes.MapType) else cel_device(device)
    for expression in expressions:
        result = cel_eval(expression, {"device": cel})
        if not isinstance(result, celpy.celtypes.BoolType):
            raise AssertionError(f"CEL runtime error, the claim's allocation aborts: {expression}: {result!r}")
        if not result:
            return False
    return True


def cel_device(device: dict[str, Any]) -> Any:
    """The `device` variable of the DRA CEL environment: driver, attributes and capacity by domain; an
    unqualified name belongs to the driver's domain."""
    attributes: dict[str, dict[str, Any]] = {}
    for name, value in device.get("attributes", {}).items():
        domain, _, ident = name.rpartition("/")
        [(kind, raw)] = value.items()
        assert kind in ("string", "int", "bool", "version")
        attributes.setdefault(domain or DRIVER_NAME, {})[ident] = raw
    return celpy.json_to_cel({"driver": DRIVER_NAME, "attributes": attributes, "capacity": {}})
