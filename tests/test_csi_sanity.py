"""csi-sanity's Identity and Node cases (kubernetes-csi/csi-test pkg/sanity identity.go, node.go), in Python:
the same requests and the same expected status codes, for every capability we advertise."""

from __future__ import annotations

import re

import grpc
import pytest

from tests.fixtures_csi import CsiHarness, needs_root, status_of
from weightcache import __version__
from weightcache.csi._pb import csi_pb2
from weightcache.csi.identity import DRIVER_NAME

RPC = csi_pb2.NodeServiceCapability.RPC
SERVICE = csi_pb2.PluginCapability.Service


# ---- Identity ----

async def test_get_plugin_info(csi: CsiHarness) -> None:
    info = await csi.identity.GetPluginInfo(csi_pb2.GetPluginInfoRequest())
    assert info.name == DRIVER_NAME and len(info.name) <= 63
    assert re.fullmatch(r"[a-zA-Z][A-Za-z0-9\-._]{0,61}[a-zA-Z]", info.name)
    assert info.vendor_version == __version__


async def test_get_plugin_capabilities_has_no_controller(csi: CsiHarness) -> None:
    caps = await csi.identity.GetPluginCapabilities(csi_pb2.GetPluginCapabilitiesRequest())
    services = [c.service.type for c in caps.capabilities if c.HasField("service")]
    assert all(t in (SERVICE.CONTROLLER_SERVICE, SERVICE.VOLUME_ACCESSIBILITY_CONSTRAINTS,
                     SERVICE.GROUP_CONTROLLER_SERVICE) for t in services)
    assert SERVICE.CONTROLLER_SERVICE not in services


async def test_probe_ready_then_fails_when_store_unusable(csi: CsiHarness) -> None:
    probe = await csi.identity.Probe(csi_pb2.ProbeRequest())
    assert probe.HasField("ready") and probe.ready.value is True
    leases = csi.store.layout.leases
    leases.rename(leases.with_name("leases.moved"))  # the store's hostPath lost its contents
    try:
        code, details = await status_of(csi.identity.Probe(csi_pb2.ProbeRequest()))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "store is not usable" in details
    finally:
        leases.with_name("leases.moved").rename(leases)
    assert (await csi.identity.Probe(csi_pb2.ProbeRequest())).ready.value


# ---- Node ----

async def test_node_get_capabilities_are_known_types(csi: CsiHarness) -> None:
    caps = await csi.node.NodeGetCapabilities(csi_pb2.NodeGetCapabilitiesRequest())
    types = [c.rpc.type for c in caps.capabilities]
    assert all(c.HasField("rpc") for c in caps.capabilities)
    assert types == [RPC.GET_VOLUME_STATS]  # no STAGE_UNSTAGE_VOLUME, no EXPAND_VOLUME


async def test_node_get_info(csi: CsiHarness) -> None:
    info = await csi.node.NodeGetInfo(csi_pb2.NodeGetInfoRequest())
    assert info.node_id == "node-a" and info.max_volumes_per_node >= 0
    assert not info.HasField("accessible_topology")


def _capability() -> csi_pb2.VolumeCapability:
    return csi_pb2.VolumeCapability(mount=csi_pb2.VolumeCapability.MountVolume(),
                                    access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))


@pytest.mark.parametrize("request_, field", [
    (csi_pb2.NodePublishVolumeRequest(), "volume_id"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="id"), "target_path"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="id", target_path="/tmp/csi-target"), "volume_capability"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="id", target_path="relative/path", volume_capability=_capability(),
                                      readonly=True), "target_path"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="id", target_path="/tmp/t", volume_capability=_capability(),
                                      readonly=True), "volume_context.model"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="id", target_path="/tmp/t", volume_capability=_capability(),
                                      readonly=True, volume_context={"model": "s3://models/llama/"}),
     "volume_context.csi.storage.k8s.io/pod.namespace"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="id", target_path="/tmp/t", volume_capability=_capability(),
                                      readonly=True, volume_context={"model": "s3://models/llama/", "tier": "gpu"}),
     "volume_context.tier"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="id", target_path="/tmp/t", volume_capability=_capability(),
                                      readonly=True, volume_context={"model": "s3://models/llama/", "timeout": "soon",
                                                                   "csi.storage.k8s.io/pod.namespace": "ml"}),
     "volume_context.timeout"),
    (csi_pb2.NodePublishVolumeRequest(volume_id="x" * 129, target_path="/tmp/t"), "volume_id"),
])
async def test_node_publish_invalid_argument_names_the_field(csi: CsiHarness, request_, field: str) -> None:
    code, details = await status_of(csi.node.NodePublishVolume(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert details.startswith(field + ":"), details


async def test_node_publish_block_access_is_refused(csi: CsiHarness) -> None:
    capability = csi_pb2.VolumeCapability(block=csi_pb2.VolumeCapability.BlockVolume(),
                                          access_mode=csi_pb2.VolumeCapability.AccessMode(mode=1))
    code, details = await status_of(csi.node.NodePublishVolume(csi_pb2.NodePublishVolumeRequest(
        volume_id="id", target_path="/tmp/t", volume_capability=capability, readonly=True)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith("volume_capability.block:")


@pytest.mark.parametrize("request_", [csi_pb2.NodeUnpublishVolumeRequest(),
                                      csi_pb2.NodeUnpublishVolumeRequest(volume_id="id")])
async def test_node_unpublish_missing_fields(csi: CsiHarness, request_) -> None:
    code, _ = await status_of(csi.node.NodeUnpublishVolume(request_))
    assert code == grpc.StatusCode.INVALID_ARGUMENT


@needs_root
async def test_node_unpublish_removes_target_path(csi: CsiHarness) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("sanity-unpublish"))
    assert csi.target("sanity-unpublish").is_dir()
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("sanity-unpublish"))
    assert not csi.target("sanity-unpublish").exists()


async def test_node_get_volume_stats_errors(csi: CsiHarness) -> None:
    stats = csi.node.NodeGetVolumeStats
    req = csi_pb2.NodeGetVolumeStatsRequest
    assert (await status_of(stats(req(volume_path="some/path"))))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert (await status_of(stats(req(volume_id="id"))))[0] == grpc.StatusCode.INVALID_ARGUMENT
    assert (await status_of(stats(req(volume_id="id", volume_path="some/path"))))[0] == grpc.StatusCode.NOT_FOUND


@needs_root
async def test_node_get_volume_stats_wrong_path_is_not_found(csi: CsiHarness) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("sanity-stats"))
    code, _ = await status_of(csi.node.NodeGetVolumeStats(
        csi_pb2.NodeGetVolumeStatsRequest(volume_id="sanity-stats", volume_path="some/path")))
    assert code == grpc.StatusCode.NOT_FOUND
    await csi.node.NodeUnpublishVolume(csi.unpublish_request("sanity-stats"))


async def test_unadvertised_rpcs_are_unimplemented(csi: CsiHarness) -> None:
    calls = [
        csi.node.NodeStageVolume(csi_pb2.NodeStageVolumeRequest(volume_id="id", staging_target_path="/tmp/s",
                                                                volume_capability=_capability())),
        csi.node.NodeUnstageVolume(csi_pb2.NodeUnstageVolumeRequest(volume_id="id", staging_target_path="/tmp/s")),
        csi.node.NodeExpandVolume(csi_pb2.NodeExpandVolumeRequest(volume_id="id", volume_path="/tmp/t")),
    ]
    for call in calls:
        assert (await status_of(call))[0] == grpc.StatusCode.UNIMPLEMENTED


async def test_secrets_are_never_logged(csi: CsiHarness, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("DEBUG", logger="weightcache.csi")
    request = csi.publish_request("vol-secret", readonly=False)
    request.secrets["token"] = "s3cr3t-value"
    code, details = await status_of(csi.node.NodePublishVolume(request))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "NodePublishVolume request" in caplog.text and "vol-secret" in caplog.text
    assert "s3cr3t-value" not in caplog.text and "s3cr3t-value" not in details
