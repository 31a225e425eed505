"""store/holders.py: every lease holder is named and described in one place, CSI's and DRA's alike."""

from __future__ import annotations

from pathlib import Path

from weightcache.csi.reconcile import VolumeBook, VolumeRecord
from weightcache.dra.claims import ClaimBook, ClaimRecord, PreparedDevice
from weightcache.store.fsops import Tree
from weightcache.store.holders import claim_of_holder, csi_holder, describe_holder, dra_holder


def test_a_csi_holder_names_its_pod(tmp_path: Path) -> None:
    VolumeBook(tmp_path).put(VolumeRecord("vol-1", "/k/pods/u/mount", "s3://b/m/", "snap", pod_namespace="ml",
                                          pod_name="vllm-0", pod_uid="u"))
    assert describe_holder(tmp_path, csi_holder("vol-1")) == "pod ml/vllm-0 (CSI volume vol-1 at /k/pods/u/mount)"
    assert describe_holder(tmp_path, csi_holder("vol-2")) == "CSI volume vol-2"


def test_a_dra_holder_names_its_claim(tmp_path: Path) -> None:
    tree = Tree(tmp_path.resolve())
    device = PreparedDevice("model", "node-1", "m-abc-0", "abc", "/h", "/models/model", "WEIGHTCACHE_MODEL_PATH")
    ClaimBook(tree).put(ClaimRecord("uid-1", "ml", "vllm-0-model", (device,), 1.0))
    holder = dra_holder("uid-1", "m-abc-0")
    assert claim_of_holder(holder) == "uid-1" and claim_of_holder(csi_holder("v")) is None
    assert describe_holder(tree, holder) == "ResourceClaim ml/vllm-0-model (DRA device m-abc-0)"
    assert describe_holder(tree, dra_holder("uid-2", "d")) == "ResourceClaim uid uid-2 (DRA device d)"
    assert describe_holder(tree, "dra:../x/d") == "ResourceClaim uid .. (DRA device x/d)"
    assert describe_holder(tree, "cli:prefetch") == "cli:prefetch"
