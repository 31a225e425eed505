"""Scale from zero with binding conditions (Kubernetes 1.36+), the scheduler's side played against the fake API
server: the node publishes a fetchable device (and its pool's `cache` counter) for a model no node holds, the
slices match the official 1.36 schema, an allocation names the device with its binding conditions, and the
driver fetches the model for real (file://) through a FetchQueue and sets `weightcache.io/model-ready` on the
claim; kubelet then prepares it. A refused namespace gets `weightcache.io/model-failed` in the policy's words, and
nothing is fetched."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fake_rules import daemon_user, shipped_rbac
from tests.fixtures_daemon import eventually
from tests.fixtures_dra import NODE, Kubelet
from tests.fixtures_k8s_schema import validate_strict
from tests.sample import make_model
from tests.test_dra_slices import check_slice
from weightcache.access import Authority
from weightcache.dra import DRIVER_NAME
from weightcache.dra.binding import ClaimBinder
from weightcache.dra.fetchable import (
    MODEL_FAILED,
    MODEL_READY,
    SIZE_ANNOTATION,
    cache_counters,
    declared,
    device_name,
    fetchable_devices,
)
from weightcache.dra.server import DraPlugin, claim_reader, serve_dra
from weightcache.dra.slices import SlicePublisher
from weightcache.fetch import Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.store import Store
from weightcache.uri import model_key

BUDGET = 64 << 20
pytestmark = pytest.mark.shipped_access  # the apiserver fixture enforces deploy/'s RBAC and policies


@dataclass
class Node:
    root: Path
    api: FakeApiServer
    store: Store
    uri: str
    caches: list[dict[str, Any]]
    publisher: SlicePublisher
    binder: ClaimBinder
    plugin: DraPlugin
    kubelet: Kubelet

    @property
    def key(self) -> str:
        return model_key(self.uri)

    def allocate(self, namespace: str, name: str) -> dict[str, Any]:
        """What the scheduler writes: the claim, then an allocation result copying the device's conditions."""
        claim = self.api.create("resourceclaims", {"metadata": {"name": name}, "spec": {"devices": {"requests": [
            {"name": "model", "exactly": {"deviceClassName": DRIVER_NAME}}]}}}, namespace)
        claim["status"] = allocation(self.key)
        return self.api.update("resourceclaims", name, claim, namespace=namespace, subresource="status")


def allocation(key: str, at: str = "2026-01-01T00:00:00Z") -> dict[str, Any]:
    """The scheduler's allocation of the model's fetchable device on NODE (a node-local pool: the node selector
    names the node, which is what lets the daemon's node-bound token write the device's status)."""
    return {"allocation": {
        "devices": {"results": [{"request": "model", "driver": DRIVER_NAME, "pool": NODE, "device": device_name(key),
                                 "bindingConditions": [MODEL_READY], "bindingFailureConditions": [MODEL_FAILED]}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [NODE]}]}]},
        "allocationTimestamp": at}}


def verdict(api: FakeApiServer, namespace: str, name: str) -> dict[str, Any] | None:
    for entry in (api.get("resourceclaims", name, namespace).get("status") or {}).get("devices") or []:
        for c in entry.get("conditions") or []:
            if c["type"] in (MODEL_READY, MODEL_FAILED) and c["status"] == "True":
                return dict(c)
    return None


@pytest.fixture
async def node(apiserver: FakeApiServer) -> AsyncIterator[Node]:
    root = Path(tempfile.mkdtemp(prefix="drab-", dir="/tmp"))
    make_model(root / "src" / "llama", layers=2, hidden=64, seed=3)
    uri = f"file://{root}/src/llama/"
    size = sum(p.stat().st_size for p in (root / "src" / "llama").rglob("*") if p.is_file())
    caches = [{"metadata": {"name": "llama", "annotations": {SIZE_ANNOTATION: str(size)}},
               "spec": {"source": uri, "allowedNamespaces": ["ml"]}}]
    store = Store(root / "store", budget_bytes=BUDGET)
    fetcher = Fetcher(store, chunk_size=64 << 10)
    queue = FetchQueue(fetcher)
    authority = Authority(model_caches=lambda: caches, allow_undeclared=lambda: False)

    def resolve(key: str) -> Any:
        return declared(caches).get(key)

    api = apiserver
    client = api.api_client(api.token_for(daemon_user(NODE)))  # the daemon's token, as on 1.36
    held = lambda: {model_key(i.snapshot.uri) for i in store.list()}  # noqa: E731
    publisher = SlicePublisher(client, NODE,
                               lambda: fetchable_devices(declared(caches).values(), held=held()),
                               counters=lambda: cache_counters(BUDGET - store.used_bytes()))
    binder = ClaimBinder(client, pool=NODE, store=store, authority=authority, resolve=resolve,
                         fetch=lambda grant: queue.ensure(grant, keep=True))
    plugin = await serve_dra(store=store, pool=NODE, kubelet_dir=root / "kubelet", cdi_dir=root / "cdi",
                             authority=authority, claims=claim_reader(client), fetchable=resolve,
                             binder=binder)
    kubelet = Kubelet(root / "kubelet")
    try:
        yield Node(root, api, store, uri, caches, publisher, binder, plugin, kubelet)
    finally:
        await kubelet.close()
        await plugin.stop(0)
        queue.close()
        store.close()
        shutil.rmtree(root, ignore_errors=True)


def test_fetchable_slices_match_the_136_schema(node: Node) -> None:
    assert node.publisher.sync()
    slices = sorted(node.api.list("resourceslices"), key=lambda s: s["metadata"]["name"])
    for obj in slices:
        check_slice(obj, "1.36")
    counters, devices = slices[0]["spec"], slices[1]["spec"]
    assert "devices" not in counters and counters["sharedCounters"][0]["name"] == "cache"
    assert counters["pool"]["resourceSliceCount"] == 2 == len(slices)
    [device] = devices["devices"]
    assert device["name"] == f"f-{node.key}" and device["bindingConditions"] == [MODEL_READY]
    assert device["attributes"]["ready"] == {"bool": False}
    assert device["consumesCounters"][0]["counterSet"] == "cache"


async def test_allocation_of_a_fetchable_device_fetches_and_sets_model_ready(node: Node) -> None:
    node.publisher.sync()
    assert node.store.list() == []
    started = time.monotonic()
    claim = node.allocate("ml", "c1")
    ready = await eventually(lambda: verdict(node.api, "ml", "c1"), timeout=60, what="the binding condition")
    took = time.monotonic() - started
    print(f"\nallocation -> {MODEL_READY}: {took:.2f} s")
    assert ready["type"] == MODEL_READY and ready["reason"] == "Fetched", ready
    [info] = node.store.list()
    assert info.snapshot.uri == node.uri
    got = node.api.get("resourceclaims", "c1", "ml")
    validate_strict({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim", **got}, "1.36")
    uid = got["metadata"]["uid"]
    assert f"dra:{uid}/f-{node.key}" in node.store.leases()  # kept until NodePrepare takes the same lease

    node.publisher.sync(full=True)  # held now: no longer offered for fetch
    assert all(d["name"] != f"f-{node.key}" for s in node.api.list("resourceslices")
               for d in s["spec"].get("devices", []))

    await node.kubelet.register()
    answer = (await node.kubelet.prepare(claim)).claims[uid]
    assert answer.error == "" and answer.devices[0].device_name == f"f-{node.key}"
    assert (node.root / "cdi" / f"{DRIVER_NAME}-{uid}.json").is_file()
    assert (await node.kubelet.unprepare(claim)).claims[uid].error == ""
    assert not [h for h in node.store.leases() if uid in h]


async def test_a_refused_namespace_gets_model_failed_and_nothing_is_fetched(node: Node) -> None:
    node.allocate("intruder", "c2")
    failed = await eventually(lambda: verdict(node.api, "intruder", "c2"), timeout=30, what="the failure")
    assert failed["type"] == MODEL_FAILED and failed["reason"] == "NotAllowed"
    assert "allowedNamespaces" in failed["message"] and "intruder" in failed["message"]
    await asyncio.sleep(0.2)
    assert node.store.list() == []


async def test_a_deleted_unprepared_claim_gives_its_lease_back(node: Node) -> None:
    claim = node.allocate("ml", "c3")
    await eventually(lambda: verdict(node.api, "ml", "c3"), timeout=60, what="model-ready")
    uid = claim["metadata"]["uid"]
    assert any(uid in h for h in node.store.leases())
    node.api.delete("resourceclaims", "c3", "ml")
    await eventually(lambda: not any(uid in h for h in node.store.leases()), what="the lease to go")


def test_the_prioritized_template_prefers_a_held_device_then_a_fetchable_one(tmp_path: Path) -> None:
    from tests.fixtures_dra import fetch_models
    from tests.test_dra_slices import matches
    from weightcache.dra.devices import devices_for
    from weightcache.dra.template import claim_template

    store = Store(tmp_path / "store")
    [held] = fetch_models(store, tmp_path / "src", 1)
    make_model(tmp_path / "other", layers=1, hidden=32, seed=9)
    other = f"file://{tmp_path}/other/"
    caches = [{"metadata": {"name": n, "annotations": {SIZE_ANNOTATION: "1000"}},
               "spec": {"source": u, "allowedNamespaces": ["ml"]}} for n, u in (("a", held.uri), ("b", other))]
    devices = devices_for([held], slots=2, shared=False) + fetchable_devices(
        declared(caches).values(), held={model_key(held.uri)})
    for uri, wanted in ((held.uri, "held"), (other, "fetch")):
        template = claim_template(uri, namespace="ml", fetchable=True)
        validate_strict(template, "1.36")
        [request] = template["spec"]["spec"]["devices"]["requests"]
        chosen = None
        for sub in request["firstAvailable"]:  # the scheduler tries them in order
            found = [d["name"] for d in devices
                     if all(matches(s["cel"]["expression"], d) for s in sub["selectors"])]
            if found:
                chosen = sub["name"], found
                break
        assert chosen is not None and chosen[0] == wanted, (uri, chosen)
        key = model_key(uri)
        assert all((n == f"f-{key}") if wanted == "fetch" else n.startswith(f"m-{held.id}") for n in chosen[1])
    store.close()


async def test_a_reallocation_after_model_failed_is_answered_and_fetches_again(node: Node) -> None:
    """A transient fetch failure (the source is not there yet) answers model-failed; the scheduler un-allocates
    (the API server drops the device's status) and allocates the same device to the same claim again: that new
    allocation is a new question, answered at once with a new fetch."""
    source = Path(node.uri.removeprefix("file://"))
    hidden = source.with_name("llama-later")
    source.rename(hidden)
    node.allocate("ml", "c4")
    failed = await eventually(lambda: verdict(node.api, "ml", "c4"), timeout=30, what="model-failed")
    assert failed["type"] == MODEL_FAILED and failed["reason"] == "FetchFailed", failed

    claim = node.api.get("resourceclaims", "c4", "ml")
    claim["status"] = {}  # the scheduler un-allocates after a binding failure
    claim = node.api.update("resourceclaims", "c4", claim, namespace="ml", subresource="status")
    assert "devices" not in claim["status"]  # dropped with the allocation, as the API server does
    hidden.rename(source)
    claim["status"] = allocation(node.key, at="2026-01-01T00:00:07Z")
    node.api.update("resourceclaims", "c4", claim, namespace="ml", subresource="status")
    ready = await eventually(lambda: verdict(node.api, "ml", "c4"), timeout=30, what="the second allocation's answer")
    assert ready["type"] == MODEL_READY, ready


async def test_a_refused_status_write_is_retried_on_its_own_clock_and_logged_whole(
        node: Node, caplog: pytest.LogCaptureFixture) -> None:
    """Without the 1.36 `resourceclaims/driver` grant the API server refuses the condition with a 422 whose end
    names the missing permission; once RBAC is fixed the binder's own retry lands it, with no claim event."""
    node.api.rbac = shipped_rbac().without("resourceclaims/driver")
    node.allocate("intruder", "c5")
    await asyncio.to_thread(node.api.wait_requests, "PATCH", "/resourceclaims/c5/status", 1, 30)
    await eventually(lambda: "failed" in caplog.text, what="the refusal in the log")
    assert 'verb="[associated-node:patch arbitrary-node:patch]"' in caplog.text
    assert 'cannot associated-node:patch resource \\"resourceclaims/driver\\"' in caplog.text \
        or 'cannot associated-node:patch resource "resourceclaims/driver"' in caplog.text
    assert verdict(node.api, "intruder", "c5") is None
    node.api.rbac = shipped_rbac()
    failed = await eventually(lambda: verdict(node.api, "intruder", "c5"), timeout=10, what="the retried write")
    assert failed["reason"] == "NotAllowed"


def test_an_idle_pool_with_decimal_sizes_is_not_rewritten_on_resync(apiserver: FakeApiServer) -> None:
    """The API server stores quantities canonically (`10000000000` -> `10G`); an idle node with a decimal disk
    budget and a ModelCache of a decimal size must compare equal on every full resync: one write, generation 1."""
    caches = [{"metadata": {"name": "big", "annotations": {SIZE_ANNOTATION: "5000000"}},
               "spec": {"source": "s3://models/big/", "allowedNamespaces": ["ml"]}}]
    daemon = apiserver.api_client(apiserver.token_for(daemon_user(NODE)))  # its own token, under the shipped RBAC
    publisher = SlicePublisher(daemon, NODE, lambda: fetchable_devices(declared(caches).values()),
                               counters=lambda: cache_counters(10_000_000_000))
    for _ in range(4):
        publisher.sync(full=True)
    slices = apiserver.list("resourceslices")
    assert [s["spec"]["pool"]["generation"] for s in slices] == [1, 1]
    assert len(apiserver.requests_matching("PUT", "/resourceslices")) == 0
    counters = next(s for s in slices if "sharedCounters" in s["spec"])["spec"]["sharedCounters"]
    assert counters[0]["counters"]["bytes"]["value"] == "10G"  # stored canonical, as the real server does
