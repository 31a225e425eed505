"""One shared device per cached snapshot with consumable capacity (KEP-5075, beta in 1.36), and the device metadata
file (KEP-5304, beta in 1.37) in the container beside WEIGHTCACHE_MODEL_PATH.

The scheduler's side is played as the 1.36 API defines it: the published slice (official 1.36 schema, strict, and
the API's capacity rules), a claim asking `capacity.requests`, and allocation results carrying `shareID` and
`consumedCapacity`; kubelet's side over the v1 DRA gRPC protos: several claims share one device, each gets its own
CDI spec, lease and metadata file, and unpreparing one leaves the others. The metadata stream is checked against
the published DeviceMetadata types (k8s.io/dynamic-resource-allocation/api/metadata v1beta1 and v1alpha1) with
attribute values checked by the official resource.k8s.io/v1 DeviceAttribute schema."""

from __future__ import annotations

import hashlib
import json
import uuid
from importlib.resources import files
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from referencing import Registry, Resource

from tests.fixtures_dra import ALLOWED_NS, NODE, DraHarness
from tests.fixtures_k8s_schema import validate_strict
from tests.test_dra_plugin import check_cdi, spec_file
from tests.test_dra_slices import check_slice
from weightcache.daemon.dra import sharing
from weightcache.dra import DRIVER_NAME
from weightcache.dra.devices import READERS, device_name, devices_for
from weightcache.dra.metadata import API_VERSIONS, POD_CLAIM_ANNOTATION
from weightcache.dra.slices import build_slices, dropped_fields
from weightcache.errors import InUseError
from weightcache.store import Snapshot
from weightcache.uri import model_key

METADATA_ROOT = "/var/run/kubernetes.io/dra-device-attributes"
_DNS_LABEL = "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
_DEFS = "https://kubernetes.io/api/_definitions.json"


def metadata_validator() -> jsonschema.Validator:
    """DeviceMetadata as its Go types define it (v1beta1; v1alpha1 has the same fields): TypeMeta and ObjectMeta,
    optional podClaimName (a DNS label), requests[] {name (required), devices[] {driver (<= 63, a DNS subdomain),
    pool, name (a DNS label), attributes (<= 32, each a resource.k8s.io/v1 DeviceAttribute), networkData}}."""
    folder = files("kubernetes_validate").joinpath("kubernetes-json-schema", "v1.37.0-local-strict")
    defs = Resource.from_contents(json.loads(folder.joinpath("_definitions.json").read_text()))
    device = {"type": "object", "additionalProperties": False, "required": ["driver", "pool", "name"],
              "properties": {
                  "driver": {"type": "string", "maxLength": 63,
                             "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"},
                  "pool": {"type": "string", "maxLength": 253, "minLength": 1},
                  "name": {"type": "string", "pattern": _DNS_LABEL},
                  "attributes": {"type": "object", "maxProperties": 32, "additionalProperties": {
                      "$ref": f"{_DEFS}#/$defs/io.k8s.api.resource.v1.DeviceAttribute"}},
                  "networkData": {"$ref": f"{_DEFS}#/$defs/io.k8s.api.resource.v1.NetworkDeviceData"}}}
    schema = {"type": "object", "additionalProperties": False, "required": ["kind", "apiVersion", "metadata"],
              "properties": {
                  "kind": {"const": "DeviceMetadata"},
                  "apiVersion": {"enum": ["metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]},
                  "metadata": {"$ref": f"{_DEFS}#/$defs/io.k8s.apimachinery.pkg.apis.meta.v1.ObjectMeta"},
                  "podClaimName": {"type": "string", "pattern": _DNS_LABEL},
                  "requests": {"type": "array", "items": {
                      "type": "object", "additionalProperties": False, "required": ["name"],
                      "properties": {"name": {"type": "string", "minLength": 1},
                                     "devices": {"type": "array", "items": device}}}}}}
    return jsonschema.Draft202012Validator(schema, registry=defs @ Registry())


def read_stream(path: Path) -> list[dict[str, Any]]:
    """The objects of a metadata file, in order (a JSON stream, as the Go decoder reads it)."""
    decoder, text, objects, at = json.JSONDecoder(), path.read_text(), [], 0
    while (at := len(text) - len(text[at:].lstrip())) < len(text):
        obj, at = decoder.raw_decode(text, at)
        objects.append(obj)
    return objects


def tree_sha256(root: Path) -> str:
    """The digest the file must carry, computed from the files on disk (sha256 of each file's bytes)."""
    h = hashlib.sha256()
    for f in sorted((p for p in root.rglob("*") if p.is_file()), key=lambda p: p.relative_to(root).as_posix()):
        h.update(f"{f.relative_to(root).as_posix()}\0{f.stat().st_size}\0{hashlib.sha256(f.read_bytes()).hexdigest()}\n"
                 .encode())
    return h.hexdigest()


def share(h: DraHarness, snap: Snapshot, request: str = "model") -> dict[str, Any]:
    """An allocation result for a share of the snapshot's shared device, as the 1.36 scheduler writes it."""
    return {"request": request, "driver": DRIVER_NAME, "pool": NODE, "device": device_name(snap.id, None),
            "shareID": str(uuid.uuid4()), "consumedCapacity": {READERS: "1"}}


def claim_with(h: DraHarness, name: str, results: list[dict[str, Any]], *, requests: list[dict[str, Any]] | None = None,
               annotations: dict[str, str] | None = None) -> dict[str, Any]:
    requests = requests or [{"name": "model", "exactly": {"deviceClassName": DRIVER_NAME,
                                                          "capacity": {"requests": {READERS: "1"}}}}]
    meta: dict[str, Any] = {"name": name, **({"annotations": annotations} if annotations else {})}
    claim = h.api.create("resourceclaims", {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                            "metadata": meta, "spec": {"devices": {"requests": requests}}}, ALLOWED_NS)
    claim["status"] = {"allocation": {"devices": {"results": results}}}
    stored = h.api.update("resourceclaims", name, claim, namespace=ALLOWED_NS, subresource="status")
    validate_strict(stored, "1.36")  # what the 1.36 API server accepts from the scheduler
    return stored


def test_a_shared_device_has_consumable_readers_and_validates(tmp_path: Path) -> None:
    snap = Snapshot("a" * 40, tmp_path, "s3://models/llama/", "main", 7)
    [device] = devices_for([snap], slots=16, shared=True)
    assert device["name"] == f"m-{snap.id}" and device["allowMultipleAllocations"] is True
    assert device["capacity"] == {READERS: {"value": "16", "requestPolicy": {"default": "1", "validValues": ["1"]}}}
    for version in ("1.36", "1.37"):
        check_slice(build_slices(NODE, [device], 1)[0], version)
    with pytest.raises(AssertionError, match="allowMultipleAllocations"):  # the API's rule, checked here too
        check_slice(build_slices(NODE, [{**device, "allowMultipleAllocations": False}], 1)[0], "1.36")


def test_auto_shares_where_the_api_server_is_1_36_or_newer() -> None:
    assert sharing(None, "v1", (1, 36)) is True and sharing(None, "v1", (1, 37)) is True
    assert sharing(None, "v1", (1, 35)) is False and sharing(None, "v1", None) is False
    assert sharing(None, "v1beta2", (1, 36)) is False
    assert sharing(False, "v1", (1, 37)) is False and sharing(True, "v1", (1, 34)) is True


async def test_claims_sharing_one_device_are_prepared_and_unprepared_apart(dra: DraHarness) -> None:
    await dra.kubelet.register()
    snap = dra.snapshots[0]
    a = claim_with(dra, "reader-a", [share(dra, snap)])
    b = claim_with(dra, "reader-b", [share(dra, snap)])
    answer = await dra.kubelet.prepare(a, b)
    ids = {}
    for claim in (a, b):
        uid = claim["metadata"]["uid"]
        entry = answer.claims[uid]
        assert entry.error == ""
        [device] = entry.devices
        assert device.device_name == f"m-{snap.id}"
        [ids[uid]] = device.cdi_device_ids
        spec = json.loads(spec_file(dra, uid).read_text())
        check_cdi(spec)
        [cdi_device] = spec["devices"]
        assert ids[uid].endswith("=" + cdi_device["name"])
        assert cdi_device["containerEdits"]["mounts"][0]["hostPath"] == str(snap.path)
    assert len(set(ids.values())) == 2
    holders = {f"dra:{c['metadata']['uid']}/m-{snap.id}": snap.id for c in (a, b)}
    assert dra.store.leases() == holders

    a_uid, b_uid = a["metadata"]["uid"], b["metadata"]["uid"]
    metadata_dir = dra.kubelet_dir / "plugins" / DRIVER_NAME / "metadata"
    b_meta = metadata_dir / f"{b_uid}_model.json"
    assert {p.name for p in metadata_dir.iterdir()} == {f"{a_uid}_model.json", b_meta.name}
    assert (await dra.kubelet.unprepare(a)).claims[a_uid].error == ""
    assert not spec_file(dra, a_uid).exists() and spec_file(dra, b_uid).exists() and b_meta.is_file()
    assert {p.name for p in metadata_dir.iterdir()} == {b_meta.name}
    assert dra.store.leases() == {f"dra:{b_uid}/m-{snap.id}": snap.id}
    with pytest.raises(InUseError, match=b_uid):
        dra.store.evict(snap.id)
    assert (await dra.kubelet.unprepare(b)).claims[b_uid].error == ""
    assert dra.store.leases() == {} and not b_meta.exists()


async def test_two_shares_of_one_device_in_one_claim_are_two_cdi_devices(dra: DraHarness) -> None:
    await dra.kubelet.register()
    snap = dra.snapshots[1]
    requests = [{"name": n, "exactly": {"deviceClassName": DRIVER_NAME}} for n in ("draft", "target")]
    config = [{"requests": ["draft"], "opaque": {"driver": DRIVER_NAME, "parameters": {"mountPath": "/models/d"}}}]
    claim = claim_with(dra, "two", [share(dra, snap, "draft"), share(dra, snap, "target")], requests=requests)
    claim["status"]["allocation"]["devices"]["config"] = config
    claim = dra.api.update("resourceclaims", "two", claim, namespace=ALLOWED_NS, subresource="status")
    uid = claim["metadata"]["uid"]
    entry = (await dra.kubelet.prepare(claim)).claims[uid]
    assert entry.error == "" and [list(d.request_names) for d in entry.devices] == [["draft"], ["target"]]
    spec = json.loads(spec_file(dra, uid).read_text())
    check_cdi(spec)
    names = [d["name"] for d in spec["devices"]]
    assert len(set(names)) == 2 and {d.cdi_device_ids[0].split("=")[1] for d in entry.devices} == set(names)
    paths = [[m["containerPath"] for m in d["containerEdits"]["mounts"]] for d in spec["devices"]]
    assert paths == [["/models/d", f"{METADATA_ROOT}/resourceclaims/two/draft/{DRIVER_NAME}-metadata.json"],
                     ["/models/model", f"{METADATA_ROOT}/resourceclaims/two/target/{DRIVER_NAME}-metadata.json"]]


async def test_the_metadata_file_follows_the_published_format(dra: DraHarness) -> None:
    """A claim from a template, allocated through a prioritized list: the file sits under the pod's claim name and
    the top-level request, carries `<request>/<subrequest>`, and is a v1beta1 then v1alpha1 stream."""
    await dra.kubelet.register()
    snap = dra.snapshots[0]
    requests = [{"name": "model", "firstAvailable": [{"name": "held", "deviceClassName": DRIVER_NAME}]}]
    result = {**dra.device(snap, 2, request="model/held")}
    claim = claim_with(dra, "vllm-0-wc-model-x7k2p", [result], requests=requests,
                       annotations={POD_CLAIM_ANNOTATION: "wc-model"})
    uid = claim["metadata"]["uid"]
    assert (await dra.kubelet.prepare(claim)).claims[uid].error == ""
    [device] = json.loads(spec_file(dra, uid).read_text())["devices"]
    model, meta = device["containerEdits"]["mounts"]
    assert meta["containerPath"] == f"{METADATA_ROOT}/resourceclaimtemplates/wc-model/model/{DRIVER_NAME}-metadata.json"
    assert "ro" in meta["options"] and device["containerEdits"]["env"] == ["WEIGHTCACHE_MODEL_PATH=/models/model"]
    host = Path(meta["hostPath"])
    assert host.stat().st_mode & 0o777 == 0o644
    objects = read_stream(host)
    assert [o["apiVersion"] for o in objects] == list(API_VERSIONS) == [
        "metadata.resource.k8s.io/v1beta1", "metadata.resource.k8s.io/v1alpha1"]
    validator = metadata_validator()
    for obj in objects:
        validator.validate(obj)
        assert obj["metadata"] == {"name": "vllm-0-wc-model-x7k2p", "namespace": ALLOWED_NS, "uid": uid,
                                   "generation": 1}
        assert obj["podClaimName"] == "wc-model"
        [request] = obj["requests"]
        assert request["name"] == "model/held"
        [dev] = request["devices"]
        assert (dev["driver"], dev["pool"], dev["name"]) == (DRIVER_NAME, NODE, f"m-{snap.id}-2")
        attrs = dev["attributes"]
        assert attrs["path"] == {"string": "/models/model"} and attrs["snapshot"] == {"string": snap.id}
        assert attrs["model"] == {"string": model_key(snap.uri)} and attrs["slot"] == {"int": 2}
        assert attrs["digest"] == {"string": tree_sha256(Path(model["hostPath"]))}
        assert attrs["digest"]["string"].startswith(snap.id)  # the snapshot id is the digest's first 40 hex
        assert ("revision" in attrs) == bool(snap.revision)
    assert objects[0] | {"apiVersion": ""} == objects[1] | {"apiVersion": ""}

    host.unlink()  # a reboot empties the plugin's run state: a repeated prepare writes it again
    spec_file(dra, uid).unlink()
    await dra.restart()
    await dra.kubelet.register()
    assert (await dra.kubelet.prepare(claim)).claims[uid].error == "" and read_stream(host) == objects


@pytest.mark.parametrize(("field", "value", "message"), [
    ("shareID", "../../etc", "is not a share id"),
    ("annotation", "../x", "is not a pod claim name"),
    ("request", "Model/x", "is not a request name"),
])
async def test_hostile_share_ids_and_names_make_no_path(dra: DraHarness, field: str, value: str,
                                                        message: str) -> None:
    await dra.kubelet.register()
    result = share(dra, dra.snapshots[0])
    annotations = None
    if field == "annotation":
        annotations = {POD_CLAIM_ANNOTATION: value}
    else:
        result[field] = value
    claim = dra.api.create("resourceclaims", {"metadata": {"name": "bad", **(
        {"annotations": annotations} if annotations else {})}, "spec": {"devices": {"requests": [
            {"name": "model", "exactly": {"deviceClassName": DRIVER_NAME}}]}}}, ALLOWED_NS)
    claim["status"] = {"allocation": {"devices": {"results": [result]}}}
    claim = dra.api.update("resourceclaims", "bad", claim, namespace=ALLOWED_NS, subresource="status")
    entry = (await dra.kubelet.prepare(claim)).claims[claim["metadata"]["uid"]]
    assert message in entry.error and dra.store.leases() == {}
    metadata_dir = dra.kubelet_dir / "plugins" / DRIVER_NAME / "metadata"
    assert not metadata_dir.exists() or not any(metadata_dir.iterdir())


def test_dropped_fields_name_what_the_server_did_not_store(tmp_path: Path) -> None:
    snap = Snapshot("c" * 40, tmp_path, "s3://models/llama/", None, 7)
    sent = build_slices(NODE, devices_for([snap], slots=4, shared=True), 1)
    assert dropped_fields(sent, sent) == set()
    stored = json.loads(json.dumps(sent))
    del stored[0]["spec"]["devices"][0]["capacity"][READERS]["requestPolicy"]
    assert dropped_fields(sent, stored) == {"capacity.requestPolicy"}
    del stored[0]["spec"]["devices"][0]["allowMultipleAllocations"]
    assert dropped_fields(sent, stored) == {"capacity.requestPolicy", "allowMultipleAllocations"}
