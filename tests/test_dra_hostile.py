"""The DRA socket replayed with hostile claims, as kubelet's side of the socket could send them: each claim gets a
clear error of its own, nothing is leased, no CDI spec or record is written outside its directory, and good
claims in the same request are prepared."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_dra import ALLOWED_NS, DraHarness
from weightcache.dra import DRIVER_NAME


def claim(namespace: str, name: str, uid: str) -> dict[str, Any]:
    return {"metadata": {"namespace": namespace, "name": name, "uid": uid}}


UID = "5e1d2c3b-0000-4000-8000-000000000000"
HOSTILE = {
    "uid traversal": (claim(ALLOWED_NS, "x", "../../etc/passwd"), "not a Kubernetes uid"),
    "uid NUL": (claim(ALLOWED_NS, "x", "abc\0def"), "not a Kubernetes uid"),
    "uid huge": (claim(ALLOWED_NS, "x", "a" * 10_000), "not a Kubernetes uid"),
    "namespace traversal": (claim("../../../api/v1", "x", UID), "claims[].namespace"),
    "namespace with slash": (claim("ml/resourceclaims/other", "x", UID), "claims[].namespace"),
    "namespace huge": (claim("n" * 100_000, "x", UID), "claims[].namespace"),
    "name traversal": (claim(ALLOWED_NS, "../../secrets/token", UID), "claims[].name"),
    "name NUL": (claim(ALLOWED_NS, "x\0y", UID), "claims[].name"),
    "name huge": (claim(ALLOWED_NS, "m" * 100_000, UID), "claims[].name"),
}


def _leftovers(dra: DraHarness) -> tuple[dict[str, str], list[str], list[str]]:
    return (dra.store.leases(), sorted(os.listdir(dra.cdi_dir)) if dra.cdi_dir.exists() else [],
            sorted(os.listdir(dra.store.root / "dra" / "claims")))


@pytest.mark.parametrize("case", sorted(HOSTILE))
async def test_hostile_claim_fields_are_refused_by_name(dra: DraHarness, case: str) -> None:
    await dra.kubelet.register()
    bad, text = HOSTILE[case]
    before = _leftovers(dra)
    answer = await dra.kubelet.prepare(bad)
    [entry] = list(answer.claims.values())
    assert text in entry.error and len(entry.error) < 4096, entry.error[:300]
    assert not entry.devices and _leftovers(dra) == before
    [gone] = list((await dra.kubelet.unprepare(bad)).claims.values())
    assert gone.error == "" or text in gone.error, gone.error[:300]
    assert _leftovers(dra) == before


async def test_the_same_claim_twice_in_one_request_is_prepared_once(dra: DraHarness) -> None:
    await dra.kubelet.register()
    snap = dra.snapshots[0]
    good = dra.allocate(ALLOWED_NS, "twice", [dra.device(snap)])
    answer = await dra.kubelet.prepare(good, good)
    [entry] = answer.claims.values()
    assert entry.error == "" and len(entry.devices) == 1
    assert len(dra.store.leases()) == 1
    await dra.kubelet.unprepare(good, good)
    assert dra.store.leases() == {}


async def test_only_our_drivers_devices_are_prepared_in_a_mixed_allocation(dra: DraHarness) -> None:
    """A claim holding a GPU of another driver next to a model: we prepare the model and never touch the GPU."""
    await dra.kubelet.register()
    snap = dra.snapshots[0]
    gpu = {"request": "gpu", "driver": "gpu.nvidia.com", "pool": "node-1", "device": "gpu-0"}
    mixed = dra.allocate(ALLOWED_NS, "mixed", [gpu, dra.device(snap)])
    answer = await dra.kubelet.prepare(mixed)
    [entry] = answer.claims.values()
    assert entry.error == "" and [d.device_name for d in entry.devices] == [dra.device(snap)["device"]]
    only_gpu = dra.allocate(ALLOWED_NS, "only-gpu", [gpu])
    [entry] = (await dra.kubelet.prepare(only_gpu)).claims.values()
    assert f"no device of driver {DRIVER_NAME}" in entry.error
    await dra.kubelet.unprepare(mixed, only_gpu)
    assert dra.store.leases() == {}


@pytest.mark.parametrize("device", [
    "m-../../../etc-0", "m-" + "a" * 40 + "-99999999999999999999", "m-" + "g" * 40 + "-0", "m-" + "a" * 40,
    "m-" + "a" * 10_000 + "-0", "", "m-\0-0",
])
async def test_device_names_that_are_not_ours_are_refused(dra: DraHarness, device: str) -> None:
    await dra.kubelet.register()
    bogus = dra.allocate(ALLOWED_NS, "bogus", [{**dra.device(dra.snapshots[0]), "device": device}])
    [entry] = (await dra.kubelet.prepare(bogus)).claims.values()
    assert entry.error and len(entry.error) < 4096 and not entry.devices
    assert "not a device this driver publishes" in entry.error or "not in the store" in entry.error, entry.error
    assert dra.store.leases() == {}


@pytest.mark.parametrize(("params", "text"), [
    ({"mountPath": "/models/../etc"}, "mountPath"),
    ({"mountPath": "relative"}, "mountPath"),
    ({"mountPath": "/"}, "mountPath"),
    ({"env": "LD_PRELOAD=x"}, "env"),
    ({"env": "A" * 1000}, "env"),
    ({"mountPath": "/m", "hostPath": "/etc"}, "unknown keys"),
    ([1, 2], "must be an object"),
])
async def test_hostile_opaque_config_is_refused(dra: DraHarness, params: Any, text: str) -> None:
    await dra.kubelet.register()
    config = [{"requests": ["model"], "opaque": {"driver": DRIVER_NAME, "parameters": params}}]
    claim_obj = dra.allocate(ALLOWED_NS, "cfg", [dra.device(dra.snapshots[0])], config)
    [entry] = (await dra.kubelet.prepare(claim_obj)).claims.values()
    assert text in entry.error and not entry.devices, entry.error
    assert dra.store.leases() == {}
    assert not any(Path(dra.cdi_dir).glob("*.json")) if dra.cdi_dir.exists() else True


def test_claim_records_go_through_the_no_follow_book_and_damage_is_quarantined(tmp_path: Path) -> None:
    """The claim book is the store's RecordBook, as the CSI volume book is: a symlink planted at `dra/claims` is
    quarantined, not followed; a damaged record (or one naming another claim) reads as unknown and is kept in
    quarantine/ for a human, and the others still read."""
    from weightcache.dra.claims import ClaimBook, ClaimRecord, PreparedDevice
    from weightcache.store import Store

    store = Store(tmp_path / "store")
    outside = tmp_path / "outside"
    outside.mkdir()
    (store.root / "dra").mkdir()
    os.symlink(outside, store.root / "dra" / "claims")
    book = ClaimBook(store.tree)
    device = PreparedDevice("model", "node-1", f"m-{'a' * 40}-0", "a" * 40, "/s", "/models/model", "P")
    record = ClaimRecord(UID, ALLOWED_NS, "c1", (device,), 1.0)
    book.put(record)
    assert list(outside.iterdir()) == [] and book.get(UID) == record
    other = UID.replace("0000-4000", "1111-4000")
    book.put(dataclasses.replace(record, uid=other))
    (book.dir / f"{other}.json").write_text((book.dir / f"{UID}.json").read_text())  # names another claim
    (book.dir / f"{UID}.json").write_text('{"uid": ')
    assert book.get(UID) is None and book.get(other) is None and book.uids() == []
    assert len([n for n in os.listdir(store.root / "quarantine") if n.startswith("dra%2Fclaims%2F")]) == 2
