"""The committed DRA stubs are exactly what scripts/gen_dra.py generates from dra/*.proto, and they speak
kubelet's wire format (the published packages, service names and field numbers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from weightcache.dra._pb import dra_health_v1alpha1_pb2, dra_v1_pb2, dra_v1beta1_pb2, pluginregistration_pb2

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "weightcache" / "dra" / "_pb"


def test_committed_stubs_equal_generated(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_dra.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    names = sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".py", ".pyi"))
    assert len(names) == 12
    for name in names:
        assert (tmp_path / name).read_bytes() == (STUBS / name).read_bytes(), (
            f"{name} differs from what scripts/gen_dra.py generates; run `python scripts/gen_dra.py` and commit")
    assert "from weightcache.dra._pb import dra_v1_pb2 as dra__v1__pb2" in (STUBS / "dra_v1_pb2_grpc.py").read_text()


def test_wire_format_matches_kubelet() -> None:
    for module, package in ((dra_v1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1"),
                            (dra_v1beta1_pb2, "k8s.io.kubelet.pkg.apis.dra.v1beta1")):
        d = module.DESCRIPTOR
        assert d.package == package
        assert d.services_by_name["DRAPlugin"].full_name == f"{package}.DRAPlugin"
        assert set(d.services_by_name["DRAPlugin"].methods_by_name) == {"NodePrepareResources",
                                                                       "NodeUnprepareResources"}
        device = d.message_types_by_name["Device"].fields_by_name
        assert {n: f.number for n, f in device.items()} == {"request_names": 1, "pool_name": 2, "device_name": 3,
                                                            "cdi_device_ids": 4}
        claim = d.message_types_by_name["Claim"].fields_by_name
        assert {n: f.number for n, f in claim.items()} == {"namespace": 1, "uid": 2, "name": 3}
        assert d.message_types_by_name["NodePrepareResourceResponse"].fields_by_name["error"].number == 2
    reg = pluginregistration_pb2.DESCRIPTOR
    assert reg.package == "pluginregistration"
    assert set(reg.services_by_name["Registration"].methods_by_name) == {"GetInfo", "NotifyRegistrationStatus"}
    info = reg.message_types_by_name["PluginInfo"].fields_by_name
    assert {n: f.number for n, f in info.items()} == {"type": 1, "name": 2, "endpoint": 3, "supported_versions": 4}
    # bytes a Go kubelet sends for Claim{namespace: "a", uid: "u", name: "n"}
    assert dra_v1_pb2.Claim(namespace="a", uid="u", name="n").SerializeToString() == b"\n\x01a\x12\x01u\x1a\x01n"


def test_health_service_names_and_fields() -> None:
    """dra/dra_health_v1alpha1.proto is written from memory of kubelet's dra-health v1alpha1 API (see its header):
    these are the names and numbers it claims, pinned so that a correction is a deliberate edit."""
    d = dra_health_v1alpha1_pb2.DESCRIPTOR
    assert d.package == "v1alpha1"
    service = d.services_by_name["DRAResourceHealth"]
    assert service.full_name == "v1alpha1.DRAResourceHealth"
    method = service.methods_by_name["NodeWatchResources"]
    assert method.server_streaming and not method.client_streaming
    health = d.message_types_by_name["DeviceHealth"].fields_by_name
    assert {n: f.number for n, f in health.items()} == {"device": 1, "health": 2, "last_updated_time": 3,
                                                        "health_check_timeout_seconds": 4}
    ident = d.message_types_by_name["DeviceIdentifier"].fields_by_name
    assert {n: f.number for n, f in ident.items()} == {"pool_name": 1, "device_name": 2}
    assert dict(d.enum_types_by_name["HealthStatus"].values_by_name.items()).keys() == {"UNKNOWN", "HEALTHY",
                                                                                       "UNHEALTHY"}
    assert d.message_types_by_name["NodeWatchResourcesResponse"].fields_by_name["devices"].number == 1
