"""The committed CSI stubs are exactly what scripts/gen_csi.py generates from csi/csi.proto, and they speak the
spec's wire format (package csi.v1, the spec's field numbers)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from weightcache.csi._pb import csi_pb2

ROOT = Path(__file__).resolve().parent.parent
STUBS = ROOT / "weightcache" / "csi" / "_pb"


def test_committed_stubs_equal_generated(tmp_path: Path) -> None:
    subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_csi.py"), "--out", str(tmp_path)], check=True,
                   capture_output=True)
    for name in ("csi_pb2.py", "csi_pb2.pyi", "csi_pb2_grpc.py"):
        assert (tmp_path / name).read_bytes() == (STUBS / name).read_bytes(), (
            f"{name} differs from what scripts/gen_csi.py generates; run `python scripts/gen_csi.py` and commit")
    assert "from weightcache.csi._pb import csi_pb2 as csi__pb2" in (STUBS / "csi_pb2_grpc.py").read_text()


def test_wire_format_matches_the_spec() -> None:
    d = csi_pb2.DESCRIPTOR
    assert d.package == "csi.v1"
    assert set(d.services_by_name) == {"Identity", "Node"}
    publish = d.message_types_by_name["NodePublishVolumeRequest"].fields_by_name
    assert {n: f.number for n, f in publish.items()} == {
        "volume_id": 1, "publish_context": 2, "staging_target_path": 3, "target_path": 4, "volume_capability": 5,
        "readonly": 6, "secrets": 7, "volume_context": 8}
    assert publish["secrets"].GetOptions().Extensions[csi_pb2.csi_secret]
    modes = csi_pb2.VolumeCapability.AccessMode.Mode
    assert modes.Value("SINGLE_NODE_WRITER") == 1 and modes.Value("SINGLE_NODE_MULTI_WRITER") == 7
    rpc = csi_pb2.NodeServiceCapability.RPC.Type
    assert rpc.Value("GET_VOLUME_STATS") == 2 and rpc.Value("VOLUME_MOUNT_GROUP") == 6
    # bytes a Go client (the spec's lib/go) would send for {volume_id: "v", readonly: true}
    assert csi_pb2.NodePublishVolumeRequest(volume_id="v", readonly=True).SerializeToString() == b"\n\x01v0\x01"
