"""kubelet-style calls with hostile fields: every one is answered with a clear status (INVALID_ARGUMENT naming the
field, or PERMISSION_DENIED), nothing is mounted, leased or written outside the store, and the plugin keeps
serving a good publish afterwards."""

from __future__ import annotations

import grpc
import pytest

from tests.fixtures_csi import ROOT_MARKS, CsiHarness, mounts_seen_from, status_of
from weightcache.csi import mounts
from weightcache.store.holders import csi_holder as holder_for

pytestmark = ROOT_MARKS

INVALID, DENIED = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.PERMISSION_DENIED

CONTEXTS: dict[str, tuple[dict[str, str], grpc.StatusCode, str]] = {
    # name: (volume_context overrides, expected code, text the message must hold)
    "huge model": ({"model": "s3://models/" + "a" * 1_000_000}, DENIED, "no ModelCache declares"),
    "NUL in model": ({"model": "s3://models/llama/\0x"}, INVALID, "volume_context.model"),
    "NUL in revision": ({"revision": "main\0"}, INVALID, "volume_context.model"),
    "revision with ..": ({"revision": "../../etc"}, INVALID, "volume_context.model"),
    "huge revision": ({"revision": "r" * 100_000}, INVALID, "volume_context.model"),
    "timeout text": ({"timeout": "soon"}, INVALID, "volume_context.timeout"),
    "timeout negative": ({"timeout": "-5s"}, INVALID, "volume_context.timeout"),
    "timeout inf": ({"timeout": "inf"}, INVALID, "volume_context.timeout"),
    "timeout nan": ({"timeout": "nan"}, INVALID, "volume_context.timeout"),
    "timeout huge digits": ({"timeout": "9" * 5000}, INVALID, "volume_context.timeout"),
    "timeout zero": ({"timeout": "0"}, INVALID, "volume_context.timeout"),
    "tier unknown": ({"tier": "gpu"}, INVALID, "volume_context.tier"),
    "tier NUL": ({"tier": "disk\0"}, INVALID, "volume_context.tier"),
    "include not strings": ({"include": "[1, 2]"}, INVALID, "volume_context.include"),
    "include object": ({"include": '[{"a": 1}]'}, INVALID, "volume_context.include"),
    "include deeply nested": ({"include": "[" * 100_000 + "]" * 100_000}, INVALID, "volume_context.include"),
    "include absolute": ({"include": "/etc/*"}, INVALID, "volume_context.include"),
    "exclude NUL": ({"exclude": "*.bin\0"}, INVALID, "volume_context.exclude"),
    "hfRepo traversal": ({"hfRepo": "../../etc"}, INVALID, "volume_context.hfRepo"),
    "namespace NUL": ({"csi.storage.k8s.io/pod.namespace": "ml\0"}, DENIED, ""),
    "namespace huge": ({"csi.storage.k8s.io/pod.namespace": "n" * 100_000}, DENIED, ""),
    "namespace missing": ({"csi.storage.k8s.io/pod.namespace": ""}, INVALID, "podInfoOnMount"),
}


@pytest.mark.parametrize("case", sorted(CONTEXTS))
async def test_hostile_volume_context(csi: CsiHarness, case: str) -> None:
    overrides, code, text = CONTEXTS[case]
    request = csi.publish_request("vol")
    for key, value in overrides.items():
        request.volume_context[key] = value
    before = mounts_seen_from(csi.root)
    got, details = await status_of(csi.node.NodePublishVolume(request))
    assert got == code, (case, got, details[:300])
    assert text in details and len(details) < 4096, details[:300]
    assert mounts_seen_from(csi.root) == before and csi.store.leases() == {}
    assert list((csi.store.root / "csi" / "volumes").iterdir()) == []
    await csi.node.NodePublishVolume(csi.publish_request("good"))  # still serving
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("good"))


async def test_unknown_volume_context_keys_are_ignored(csi: CsiHarness) -> None:
    """kubelet adds its own csi.storage.k8s.io/* keys and users add labels: not an error (docs/csi.md)."""
    request = csi.publish_request("vol")
    request.volume_context["csi.storage.k8s.io/some.future.key"] = "x"
    request.volume_context["x" * 1000] = "y" * 10_000
    assert (await status_of(csi.node.NodePublishVolume(request)))[0] == grpc.StatusCode.OK
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol"))
    assert csi.store.leases() == {}


@pytest.mark.parametrize("volume_id", ["../../../../etc/x", "a/b", "%" * 128, "é" * 64, ".", "..", " ", "\n"])
async def test_hostile_volume_ids_stay_inside_the_store(csi: CsiHarness, volume_id: str) -> None:
    """Any id up to the spec's 128 bytes is a valid id: it is quoted into one file name, published, unpublished."""
    request = csi.publish_request("x")
    request.volume_id = volume_id
    code, details = await status_of(csi.node.NodePublishVolume(request))
    assert code == grpc.StatusCode.OK, details
    assert list(csi.store.leases()) == [holder_for(volume_id)]
    assert len(holder_for(volume_id)) < 120  # a long quoted id is named by its hash in file names
    unpublish = csi.unpublish_request("x")
    unpublish.volume_id = volume_id
    assert (await status_of(csi.node.NodeUnpublishVolume(unpublish)))[0] == grpc.StatusCode.OK
    assert csi.store.leases() == {} and list((csi.store.root / "csi" / "volumes").iterdir()) == []


@pytest.mark.parametrize("volume_id", ["", "v" * 129, "a\0b"])
async def test_bad_volume_ids_are_invalid_argument(csi: CsiHarness, volume_id: str) -> None:
    request = csi.publish_request("x")
    request.volume_id = volume_id
    code, details = await status_of(csi.node.NodePublishVolume(request))
    assert code == INVALID and "volume_id" in details
    unpublish = csi.unpublish_request("x")
    unpublish.volume_id = volume_id
    code, details = await status_of(csi.node.NodeUnpublishVolume(unpublish))
    assert code == INVALID and "volume_id" in details


async def test_a_damaged_volume_record_does_not_wedge_the_volume(csi: CsiHarness) -> None:
    """A record file that is not JSON of a record (disk damage, a hand edit) is set aside, not an INTERNAL on
    every later call for that volume."""
    await csi.node.NodePublishVolume(csi.publish_request("vol"))
    [record] = list((csi.store.root / "csi" / "volumes").iterdir())
    record.write_text('{"volume_id": "vol", "unexpected": 1')
    code, details = await status_of(csi.node.NodeUnpublishVolume(csi.unpublish_request("vol")))
    assert code == grpc.StatusCode.OK, details
    assert mounts.mounted_at(csi.target("vol")) is None and csi.store.leases() == {}
    assert (await status_of(csi.node.NodePublishVolume(csi.publish_request("vol"))))[0] == grpc.StatusCode.OK
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol"))


@pytest.mark.parametrize("spelling", ["trailing slash", "double slash", "dot segment", "relative", "NUL"])
async def test_publish_to_an_odd_spelling_of_the_target_is_invalid(csi: CsiHarness, spelling: str) -> None:
    """kubelet sends the target exactly as RULE spells it; another spelling is refused, never normalised into it."""
    target = str(csi.target("vol"))
    odd = {"trailing slash": target + "/", "double slash": target.replace("/pods/", "//pods/"),
           "dot segment": target.replace("/pods/", "/pods/./"), "relative": target.lstrip("/"),
           "NUL": target + "\0"}[spelling]
    request = csi.publish_request("vol")
    request.target_path = odd
    before = mounts_seen_from(csi.root)
    code, details = await status_of(csi.node.NodePublishVolume(request))
    assert code == INVALID and "target_path" in details, details
    assert mounts_seen_from(csi.root) == before and csi.store.leases() == {}
