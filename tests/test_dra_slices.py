"""ResourceSlices: what the publisher writes to the (fake) API server, checked against the official 1.34 schema
(strict), kept current as models are fetched and evicted, and selected by the documented claim's CEL expression
evaluated with cel-python exactly as the scheduler's DRA CEL environment sees the devices."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_dra import NODE, fetch_models, selected
from tests.fixtures_k8s_schema import validate_strict
from tests.grants import granted
from tests.sample import make_model
from weightcache.dra import DRIVER_NAME
from weightcache.dra.devices import devices_for, latest_ids, snapshot_of
from weightcache.dra.slices import MAX_DEVICES_PER_SLICE, SlicePublisher, build_slices
from weightcache.dra.template import claim_template, device_class, selector
from weightcache.fetch import Fetcher, source_revision
from weightcache.sources import open_source
from weightcache.store import Snapshot, Store
from weightcache.uri import model_key, parse_ref

# Rules the schema cannot express, from the API's field docs and validation (resource.k8s.io/v1): device names
# are DNS labels, attribute names C identifiers (<= 32) optionally qualified by a DNS subdomain, string and
# version values <= 64 characters, <= 32 attributes + capacities per device, <= 128 devices per slice.
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_C_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,31}$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_slice(obj: dict[str, Any], version: str = "1.34") -> None:
    """The official schema (strict) plus the API's validation rules the schema does not carry."""
    validate_strict(obj, version)
    devices = obj["spec"].get("devices", [])
    assert not (devices and obj["spec"].get("sharedCounters")), "1.35+: devices or sharedCounters, not both"
    limit = 64 if any(d.get("consumesCounters") or d.get("taints") for d in devices) else 128
    assert len(devices) <= limit and len({d["name"] for d in devices}) == len(devices)
    for device in devices:
        assert _DNS_LABEL.match(device["name"]), device["name"]
        attrs = device.get("attributes", {})
        assert len(attrs) + len(device.get("capacity", {})) <= 32
        for name, capacity in device.get("capacity", {}).items():  # KEP-5075's validation of a requestPolicy
            policy = capacity.get("requestPolicy")
            if policy is None:
                continue
            assert device.get("allowMultipleAllocations") is True, \
                f"{name}: requestPolicy needs allowMultipleAllocations"
            values = [int(v) for v in policy.get("validValues", [])]
            assert "default" in policy and (not values or (values == sorted(values) and len(values) <= 10
                                                           and int(policy["default"]) in values))
            assert all(v <= int(capacity["value"]) for v in values), name
        for name, value in attrs.items():
            domain, _, ident = name.rpartition("/")
            assert _C_IDENT.match(ident) and (not domain or (_SUBDOMAIN.match(domain) and len(domain) <= 63)), name
            assert len(value) == 1 and all(len(str(v)) <= 64 for k, v in value.items() if k in ("string", "version"))


def matches(expression: str, device: dict[str, Any]) -> bool:
    return selected([expression], device)


def slices_of(api: FakeApiServer) -> list[dict[str, Any]]:
    return [s for s in api.list("resourceslices") if s["spec"]["nodeName"] == NODE]


def devices_of(api: FakeApiServer) -> list[dict[str, Any]]:
    return [d for s in slices_of(api) for d in s["spec"]["devices"]]


def publisher(api: FakeApiServer, store: Store, *, slots: int = 4, shared: bool = False,
              api_version: str = "v1") -> SlicePublisher:
    def devices() -> list[dict[str, Any]]:
        return devices_for([i.snapshot for i in store.list()], slots=slots, shared=shared)
    layout = store.layout
    return SlicePublisher(api.api_client(), NODE, devices, api_version=api_version,
                          change_token=lambda: (layout.snapshots.stat().st_mtime_ns,
                                                layout.manifests.stat().st_mtime_ns))


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def test_slices_follow_fetches_and_evictions_and_validate(tmp_path: Path, store: Store,
                                                          apiserver: FakeApiServer) -> None:
    pub = publisher(apiserver, store)
    assert pub.sync() is True  # an empty pool is published too: the scheduler sees the node has none
    [empty] = slices_of(apiserver)
    check_slice(empty, "1.34")
    assert empty["spec"]["devices"] == [] and empty["spec"]["pool"] == {
        "name": NODE, "generation": 1, "resourceSliceCount": 1}

    a, b = fetch_models(store, tmp_path / "src", 2)
    assert pub.sync() is True
    [one] = slices_of(apiserver)
    check_slice(one, "1.34")
    assert one["spec"]["driver"] == DRIVER_NAME and one["spec"]["pool"]["generation"] == 2
    names = sorted(d["name"] for d in one["spec"]["devices"])
    assert names == sorted(f"m-{s.id}-{i}" for s in (a, b) for i in range(4))
    device = next(d for d in one["spec"]["devices"] if d["name"] == f"m-{a.id}-0")
    assert device["attributes"] == {
        "model": {"string": model_key(a.uri)}, "snapshot": {"string": a.id}, "size": {"int": a.size},
        "tier": {"string": "disk"}, "ready": {"bool": True}, "slot": {"int": 0}, "signed": {"bool": False},
        "latest": {"bool": True}, **({"source": {"string": a.uri}} if len(a.uri) <= 64 else {}),
        **({"revision": {"string": a.revision}} if a.revision else {})}

    writes = len(apiserver.requests)
    assert pub.sync() is False and pub.sync(full=True) is False  # unchanged: no write, no generation bump
    assert not any(r.method in ("POST", "PUT", "DELETE") for r in apiserver.requests[writes:])

    store.evict(b.id)
    assert pub.sync() is True
    [after] = slices_of(apiserver)
    check_slice(after, "1.34")
    assert {snapshot_of(d["name"]) for d in after["spec"]["devices"]} == {a.id}
    assert after["spec"]["pool"]["generation"] == 3


def test_a_restarted_publisher_continues_the_generation_and_repairs_edits(store: Store,
                                                                          apiserver: FakeApiServer) -> None:
    assert publisher(apiserver, store).sync() is True
    [first] = slices_of(apiserver)
    first["spec"]["devices"] = [{"name": "planted"}]
    apiserver.update("resourceslices", first["metadata"]["name"], first)
    again = publisher(apiserver, store)
    assert again.sync() is True
    [repaired] = slices_of(apiserver)
    assert repaired["spec"]["devices"] == [] and repaired["spec"]["pool"]["generation"] == 2
    apiserver.delete("resourceslices", repaired["metadata"]["name"])  # kubelet wipes its node's slices on start
    assert again.sync() is False  # the cheap check sees no store change...
    assert again.sync(full=True) is True  # ...the periodic full sync puts the slice back
    [back] = slices_of(apiserver)
    assert back["spec"]["pool"]["generation"] == 3


def test_many_devices_span_several_slices_of_one_pool(tmp_path: Path) -> None:
    snapshots = [Snapshot(f"{i:040x}", tmp_path, f"s3://models/m{i}/", None, 10) for i in range(40)]
    slices = build_slices(NODE, devices_for(snapshots, slots=8, shared=False), 7)
    assert [len(s["spec"]["devices"]) for s in slices] == [MAX_DEVICES_PER_SLICE, 128, 64]
    assert {s["spec"]["pool"]["resourceSliceCount"] for s in slices} == {3}
    assert len({s["metadata"]["name"] for s in slices}) == 3
    for s in slices:
        check_slice(s, "1.34")


def test_long_values_are_left_out_not_cut(tmp_path: Path) -> None:
    uri = "s3://models/" + "a" * 80 + "/"
    [device] = devices_for([Snapshot("f" * 40, tmp_path, uri, "r" * 100, 1)], slots=1, shared=False)
    assert "source" not in device["attributes"] and "revision" not in device["attributes"]
    check_slice(build_slices(NODE, [device], 1)[0], "1.34")
    too_long = {**device, "attributes": {**device["attributes"], "source": {"string": uri}}}
    with pytest.raises(AssertionError):  # what the API would refuse
        check_slice(build_slices(NODE, [too_long], 1)[0], "1.34")


def test_shared_mode_and_the_1_33_api(tmp_path: Path) -> None:
    snap = Snapshot("e" * 40, tmp_path, "s3://models/llama/", "v1", 5)
    [shared] = devices_for([snap], slots=8, shared=True)
    assert shared["name"] == f"m-{snap.id}" and shared["allowMultipleAllocations"] is True
    assert snapshot_of(shared["name"]) == snap.id
    [resident] = devices_for([snap], slots=1, shared=False, resident={snap.id})
    assert resident["attributes"]["tier"] == {"string": "memory"}
    check_slice(build_slices(NODE, [shared], 1)[0], "1.34")
    v1beta2 = build_slices(NODE, devices_for([snap], slots=2, shared=False), 1, api_version="v1beta2")[0]
    assert v1beta2["apiVersion"] == "resource.k8s.io/v1beta2"
    check_slice(v1beta2, "1.33")


def test_the_documented_claim_selects_exactly_that_models_devices(tmp_path: Path) -> None:
    llama = Snapshot("1" * 40, tmp_path, "s3://models/llama-3-8b/", "rev-a", 5)
    llama_b = Snapshot("2" * 40, tmp_path, "s3://models/llama-3-8b/", "rev-b", 5)
    mistral = Snapshot("3" * 40, tmp_path, "s3://models/mistral-7b/", None, 5)
    other_bucket = Snapshot("4" * 40, tmp_path, "s3://elsewhere/llama-3-8b/", None, 5)
    unknown = Snapshot("5" * 40, tmp_path, "s3://models/llama-3-8b/", None, 5)  # fetched without a revision
    devices = devices_for([llama, llama_b, mistral, other_bucket, unknown], slots=3, shared=False)
    template = claim_template("s3://models/llama-3-8b", namespace="ml")
    validate_strict(template, "1.34")
    [request] = template["spec"]["spec"]["devices"]["requests"]
    expression = request["exactly"]["selectors"][0]["cel"]["expression"]
    assert expression == selector("s3://models/llama-3-8b/")
    chosen = {d["name"] for d in devices if matches(expression, d)}
    assert chosen == {d["name"] for d in devices if snapshot_of(d["name"]) in (llama.id, llama_b.id, unknown.id)}
    pinned = selector("s3://models/llama-3-8b/", "rev-b")
    # the device of unknown revision is a mismatch, not the error that would abort the claim on this node
    assert {snapshot_of(d["name"]) for d in devices if matches(pinned, d)} == {llama_b.id}
    with_path = claim_template("s3://models/mistral-7b/", mount_path="/models/mistral")
    validate_strict(with_path, "1.34")
    assert with_path["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"] == {
        "mountPath": "/models/mistral"}


def test_a_bad_snapshot_costs_only_its_own_devices(tmp_path: Path, store: Store, apiserver: FakeApiServer,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """One damaged index row (an id that makes no device name) or a size past int64 (the API refuses the whole
    slice for it) used to fail every publish of the node: now that snapshot alone is left out, with a warning."""
    [good] = fetch_models(store, tmp_path / "src", 1)
    bad_id = Snapshot("Z" * 40, tmp_path, "s3://models/bad/", None, 1)
    too_big = Snapshot("c" * 40, tmp_path, "s3://models/huge/", None, 1 << 64)
    not_text = Snapshot("d" * 40, tmp_path, None, None, 1)  # type: ignore[arg-type]  # a damaged record
    assert {d["name"] for d in devices_for([bad_id, good, too_big, not_text], slots=2, shared=False)} == {
        f"m-{good.id}-0", f"m-{good.id}-1"}
    assert "ZZZZ" in caplog.text and "huge" in caplog.text and "int64" in caplog.text

    def devices() -> list[dict[str, Any]]:
        return devices_for([bad_id, *(i.snapshot for i in store.list()), too_big], slots=2, shared=False)
    assert SlicePublisher(apiserver.api_client(), NODE, devices).sync() is True
    [published] = slices_of(apiserver)
    check_slice(published)
    assert {snapshot_of(d["name"]) for d in published["spec"]["devices"]} == {good.id}


def test_a_claim_without_a_revision_follows_the_served_revision_after_a_rollouts_switch(tmp_path: Path) -> None:
    """Both revisions stay devices after a rollout's switch (the old one until its pods end); the generated claim
    and device class that name no revision select the one the store's `latest` ref names (what the switch moves,
    docs/modelcache.md), and a device without `latest` (published before
    the attribute existed) still matches."""
    src = tmp_path / "src"
    make_model(src, layers=1, hidden=32, seed=1)
    uri, ref = f"file://{src}/", parse_ref(f"file://{src}/")
    store = Store(tmp_path / "root")
    old = Fetcher(store).ensure(granted(uri))  # a pod naming no revision: latest names it
    (src / "config.json").write_text('{"model_type": "llama", "revision": 2}')
    source = open_source(ref)
    revision = source_revision(source.list())[:16]
    source.close()
    new = Fetcher(store).ensure(granted(f"{uri}@{revision}"))  # the rollout's fetch, beside the old one

    def chosen(selectors: list[dict[str, Any]]) -> set[str | None]:
        infos = store.list()
        devices = devices_for([i.snapshot for i in infos], slots=2, shared=False, latest=latest_ids(infos))
        return {snapshot_of(d["name"]) for d in devices if all(matches(s["cel"]["expression"], d) for s in selectors)}

    def unnamed() -> list[dict[str, Any]]:
        return claim_template(uri)["spec"]["spec"]["devices"]["requests"][0]["exactly"]["selectors"]

    assert chosen(unnamed()) == {old.id}, "before the switch: the served (old) revision only"
    assert store.point(ref, new.id)  # the switch (daemon/reconcile.py)
    assert chosen(unnamed()) == {new.id}
    assert chosen(device_class(uri)["spec"]["selectors"]) == {new.id}
    validate_strict(claim_template(uri), "1.34")
    legacy = {"name": f"m-{old.id}-0", "attributes": {"model": {"string": model_key(uri)}, "ready": {"bool": True}}}
    assert all(matches(s["cel"]["expression"], legacy) for s in unnamed())
    store.close()
