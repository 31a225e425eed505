"""The DRA kubelet plugin, called exactly as kubelet calls it: plugin registration (GetInfo, then
NotifyRegistrationStatus) on the registration socket, then NodePrepareResources / NodeUnprepareResources on the
endpoint GetInfo names, with the stubs generated from kubelet's published protos. Claims live in the fake API
server; the CDI specs written are checked against the CDI specification's JSON schema (tests/cdi_schema)."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT7

from tests.fixtures_dra import ALLOWED_NS, NODE, DraHarness
from weightcache.dra import CDI_KIND, DRIVER_NAME
from weightcache.dra.plugin import DEFAULT_CONTAINER_PATH
from weightcache.dra.server import claim_reader, plugin_socket
from weightcache.errors import ClusterError, InUseError

SCHEMA_DIR = Path(__file__).parent / "cdi_schema"
# The CDI spec's naming rules (SPEC.md: kind is vendor/class, device names alphanumerics with _ . : -)
_KIND = re.compile(r"^[a-z0-9]([a-z0-9.-]*[a-z0-9])?/[a-zA-Z0-9]([a-zA-Z0-9_.-]*[a-zA-Z0-9])?$")
_DEVICE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.:-]*[a-zA-Z0-9])?$")


def cdi_validator() -> jsonschema.Validator:
    schema = json.loads((SCHEMA_DIR / "schema.json").read_text())
    defs = Resource.from_contents(json.loads((SCHEMA_DIR / "defs.json").read_text()), default_specification=DRAFT7)
    return jsonschema.Draft7Validator(schema, registry=Registry().with_resource("defs.json", defs))


def check_cdi(spec: dict[str, Any]) -> None:
    cdi_validator().validate(spec)
    assert _KIND.match(spec["kind"]), spec["kind"]
    for device in spec["devices"]:
        assert _DEVICE.match(device["name"]), device["name"]


def spec_file(h: DraHarness, uid: str) -> Path:
    return h.cdi_dir / f"{DRIVER_NAME}-{uid}.json"


def uid_of(claim: dict[str, Any]) -> str:
    return str(claim["metadata"]["uid"])


async def test_registration_answers_as_kubelet_expects(dra: DraHarness) -> None:
    info = await dra.kubelet.register()
    assert info.type == "DRAPlugin" and info.name == DRIVER_NAME
    assert info.endpoint == str(plugin_socket(dra.kubelet_dir))
    assert list(info.supported_versions) == ["v1.DRAPlugin", "v1beta1.DRAPlugin"]
    assert dra.plugin.registration.registered.is_set()
    await dra.kubelet.register(ok=False, error="no DRA feature")
    assert not dra.plugin.registration.registered.is_set() and dra.plugin.registration.error == "no DRA feature"


async def test_prepare_writes_a_valid_cdi_spec_and_leases_until_unprepare(dra: DraHarness) -> None:
    await dra.kubelet.register()
    snap = dra.snapshots[0]
    claim = dra.allocate(ALLOWED_NS, "llama", [dra.device(snap, 3)])
    uid = uid_of(claim)
    answer = (await dra.kubelet.prepare(claim)).claims[uid]
    assert answer.error == ""
    [device] = answer.devices
    assert (device.pool_name, device.device_name, list(device.request_names)) == (NODE, f"m-{snap.id}-3", ["model"])
    [cdi_id] = device.cdi_device_ids
    kind, _, name = cdi_id.partition("=")
    spec = json.loads(spec_file(dra, uid).read_text())
    check_cdi(spec)
    assert spec["kind"] == kind == CDI_KIND
    [cdi_device] = spec["devices"]
    assert cdi_device["name"] == name
    edits = cdi_device["containerEdits"]
    model_mount, metadata_mount = edits["mounts"]
    assert model_mount == {"hostPath": str(snap.path), "containerPath": DEFAULT_CONTAINER_PATH,
                           "options": ["ro", "rbind", "nosuid", "nodev"]}
    assert metadata_mount["containerPath"] == \
        f"/var/run/kubernetes.io/dra-device-attributes/resourceclaims/llama/model/{DRIVER_NAME}-metadata.json"
    assert "ro" in metadata_mount["options"] and Path(metadata_mount["hostPath"]).is_file()
    assert edits["env"] == [f"WEIGHTCACHE_MODEL_PATH={DEFAULT_CONTAINER_PATH}"]
    assert dra.store.leases() == {f"dra:{uid}/m-{snap.id}-3": snap.id}
    with pytest.raises(InUseError, match=f"dra:{uid}"):
        dra.store.evict(snap.id)

    gone = (await dra.kubelet.unprepare(claim)).claims[uid]
    assert gone.error == ""
    assert not spec_file(dra, uid).exists() and dra.store.leases() == {}
    assert not Path(metadata_mount["hostPath"]).exists()
    dra.store.evict(snap.id)  # nothing holds it any more
    again = (await dra.kubelet.unprepare(claim)).claims  # unknown claim: fine, kubelet may retry
    assert again[uid].error == ""


async def test_repeats_and_a_restart_answer_the_same(dra: DraHarness) -> None:
    await dra.kubelet.register()
    claim = dra.allocate(ALLOWED_NS, "llama", [dra.device(dra.snapshots[1], 0)])
    uid = uid_of(claim)
    first = await dra.kubelet.prepare(claim)
    assert first.claims[uid].error == ""
    assert await dra.kubelet.prepare(claim) == first
    dra.api.delete("resourceclaims", "llama", ALLOWED_NS)  # a repeat needs no API call: the record answers

    await dra.restart()
    spec_file(dra, uid).unlink()  # a reboot empties /var/run/cdi
    for holder in list(dra.store.leases()):
        dra.store.release(holder)  # and leases do not outlive it either
    await dra.restart()
    assert dra.store.leases() == {f"dra:{uid}/m-{dra.snapshots[1].id}-0": dra.snapshots[1].id}  # reconciled
    await dra.kubelet.register()
    assert await dra.kubelet.prepare(claim) == first
    check_cdi(json.loads(spec_file(dra, uid).read_text()))

    assert (await dra.kubelet.unprepare(claim)).claims[uid].error == ""
    assert dra.store.leases() == {} and not spec_file(dra, uid).exists()


async def test_restart_releases_leases_of_claims_never_recorded(dra: DraHarness) -> None:
    snap = dra.snapshots[0]
    dra.store.lease("dra:0b9c1a7e-dead-beef-0000-000000000000/m-x-0", snap.id)  # crash between lease and record
    dra.store.lease("csi:vol-1", snap.id)  # not ours
    await dra.restart()
    assert dra.store.leases() == {"csi:vol-1": snap.id}


async def test_namespace_not_allowed_is_refused_and_leaves_nothing(dra: DraHarness) -> None:
    await dra.kubelet.register()
    claim = dra.allocate("intruder", "llama", [dra.device(dra.snapshots[0])])
    answer = (await dra.kubelet.prepare(claim)).claims[uid_of(claim)]
    assert "allowedNamespaces" in answer.error and not answer.devices
    assert dra.store.leases() == {} and list(dra.cdi_dir.glob("*.json")) == []
    assert list((dra.store.root / "dra" / "claims").iterdir()) == []


async def test_every_claim_gets_its_own_answer(dra: DraHarness) -> None:
    await dra.kubelet.register()
    snap, other = dra.snapshots
    good = dra.allocate(ALLOWED_NS, "good", [dra.device(snap, 1)])
    unallocated = dra.allocate(ALLOWED_NS, "unallocated", [])
    foreign = dra.allocate(ALLOWED_NS, "foreign", [dra.device(snap, 0, pool="node-2")])
    bogus = dra.allocate(ALLOWED_NS, "bogus", [{**dra.device(snap), "device": "gpu-0"}])
    evicted = dra.allocate(ALLOWED_NS, "evicted", [dra.device(other)])
    dra.store.evict(other.id)
    replaced = dra.allocate(ALLOWED_NS, "replaced", [dra.device(snap, 2)])
    stale = {"metadata": {**replaced["metadata"], "uid": "6f1d2c3b-0000-4000-8000-000000000000"}}
    missing = {"metadata": {"namespace": ALLOWED_NS, "name": "missing", "uid": "7a1d2c3b-0000-4000-8000-000000000000"}}
    answer = (await dra.kubelet.prepare(good, unallocated, foreign, bogus, evicted, stale, missing)).claims
    assert set(answer) == {uid_of(c) for c in (good, unallocated, foreign, bogus, evicted, stale, missing)}
    assert answer[uid_of(good)].error == "" and len(answer[uid_of(good)].devices) == 1
    errors = {name: answer[uid_of(c)].error for name, c in (("unallocated", unallocated), ("foreign", foreign),
              ("bogus", bogus), ("evicted", evicted), ("stale", stale), ("missing", missing))}
    assert "no device of driver models.weightcache.io allocated" in errors["unallocated"]
    assert "not this node's pool 'node-1'" in errors["foreign"]
    assert "not a device this driver publishes" in errors["bogus"]
    assert "not in the store" in errors["evicted"]
    assert "deleted and created again" in errors["stale"]
    assert "HTTP 404" in errors["missing"]
    assert all(not answer[uid_of(c)].devices for c in (unallocated, foreign, bogus, evicted, stale))
    assert list(dra.store.leases()) == [f"dra:{uid_of(good)}/m-{snap.id}-1"]


async def test_claim_config_sets_mount_path_and_env(dra: DraHarness) -> None:
    await dra.kubelet.register()
    snap, draft = dra.snapshots
    config = [{"source": "FromClaim", "requests": ["draft"], "opaque": {"driver": DRIVER_NAME, "parameters": {
        "mountPath": "/models/draft", "env": "WEIGHTCACHE_MODEL_PATH_DRAFT"}}}]
    claim = dra.allocate(ALLOWED_NS, "two", [dra.device(snap), dra.device(draft, request="draft")], config)
    answer = (await dra.kubelet.prepare(claim)).claims[uid_of(claim)]
    assert answer.error == "" and [list(d.request_names) for d in answer.devices] == [["model"], ["draft"]]
    spec = json.loads(spec_file(dra, uid_of(claim)).read_text())
    check_cdi(spec)
    assert [d["containerEdits"]["env"] for d in spec["devices"]] == [
        ["WEIGHTCACHE_MODEL_PATH=/models/model"], ["WEIGHTCACHE_MODEL_PATH_DRAFT=/models/draft"]]
    bad = dra.allocate(ALLOWED_NS, "bad", [dra.device(snap)], [{"source": "FromClaim", "opaque": {
        "driver": DRIVER_NAME, "parameters": {"mountPath": "/models/../etc"}}}])
    assert "mountPath" in (await dra.kubelet.prepare(bad)).claims[uid_of(bad)].error


async def test_kubelet_1_33_calls_the_v1beta1_service(dra: DraHarness) -> None:
    await dra.kubelet.register()
    claim = dra.allocate(ALLOWED_NS, "llama", [dra.device(dra.snapshots[0])])
    answer = (await dra.kubelet.prepare_v1beta1(claim)).claims[uid_of(claim)]
    assert answer.error == "" and answer.devices[0].device_name == f"m-{dra.snapshots[0].id}-0"


def test_cdi_schema_copy_rejects_what_the_spec_forbids() -> None:
    validator = cdi_validator()
    good = {"cdiVersion": "0.5.0", "kind": CDI_KIND, "devices": [{"name": "d", "containerEdits": {
        "mounts": [{"hostPath": "/a", "containerPath": "/b", "options": ["ro"]}]}}]}
    validator.validate(good)
    for bad in ({**good, "extra": 1}, {k: v for k, v in good.items() if k != "kind"},
                {**good, "devices": [{"name": "d", "containerEdits": {"mounts": [{"hostPath": "/a"}]}}]},
                {**good, "devices": [{"name": "d", "containerEdits": {"mounts": [
                    {"hostPath": "/a", "containerPath": "/b", "options": "ro"}]}}]}):
        assert not validator.is_valid(bad)


def test_an_unreachable_api_server_is_a_retryable_claim_error() -> None:
    import socket

    import kubernetes

    with socket.socket() as free:  # a port nothing listens on
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    config = kubernetes.client.Configuration()
    config.host = f"http://127.0.0.1:{port}"
    config.retries = 0
    read = claim_reader(kubernetes.client.ApiClient(config))
    with pytest.raises(ClusterError, match="did not answer; kubelet retries"):
        read(ALLOWED_NS, "llama")


async def test_a_symlink_planted_at_the_spec_path_is_replaced_not_followed(dra: DraHarness) -> None:
    await dra.kubelet.register()
    claim = dra.allocate(ALLOWED_NS, "llama", [dra.device(dra.snapshots[0])])
    victim = dra.root / "victim"
    victim.write_text("keep me")
    dra.cdi_dir.mkdir(parents=True, exist_ok=True)
    spec_file(dra, uid_of(claim)).symlink_to(victim)
    assert (await dra.kubelet.prepare(claim)).claims[uid_of(claim)].error == ""
    assert victim.read_text() == "keep me"
    assert not spec_file(dra, uid_of(claim)).is_symlink()
    check_cdi(json.loads(spec_file(dra, uid_of(claim)).read_text()))
    (dra.root / "elsewhere").mkdir()
    claims_dir = dra.store.root / "dra" / "claims"
    for record in claims_dir.iterdir():
        record.unlink()
    claims_dir.rmdir()
    claims_dir.symlink_to(dra.root / "elsewhere")  # a planted directory symlink: records never land outside
    other = dra.allocate(ALLOWED_NS, "other", [dra.device(dra.snapshots[1])])
    await dra.restart()
    assert (await dra.kubelet.prepare(other)).claims[uid_of(other)].error == ""
    assert list((dra.root / "elsewhere").iterdir()) == []
