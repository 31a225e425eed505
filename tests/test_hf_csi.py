"""Volume attribute `hfRepo`: the CSI plugin mounts the snapshot's hub cache layout, read-only, recognises the
mount as its own (unpublish removes it, restart reconcile adopts it) and refuses a malformed repo id."""

from __future__ import annotations

import errno

import grpc
import pytest

from tests.fixtures_csi import ROOT_MARKS, CsiHarness, status_of
from weightcache.csi import mounts
from weightcache.csi.reconcile import SnapshotMounts
from weightcache.hf_layout import commit_of

pytestmark = ROOT_MARKS


async def test_hf_repo_volume_is_a_read_only_hub_cache(csi: CsiHarness) -> None:
    await csi.node.NodePublishVolume(csi.publish_request("vol-hf", hfRepo="acme/llama"))
    target = csi.target("vol-hf")
    snapshot = csi.store.list()[0].snapshot
    repo = target / "models--acme--llama"
    assert (repo / "refs" / "main").read_text() == commit_of(snapshot)
    files = repo / "snapshots" / commit_of(snapshot)
    assert (files / "config.json").stat().st_ino == (snapshot.path / "config.json").stat().st_ino
    entry = mounts.mounted_at(target)
    assert entry is not None and "ro" in entry.options
    with pytest.raises(OSError) as err:
        (repo / "refs" / "other").write_text("x")
    assert err.value.errno == errno.EROFS
    # the plugin knows the mount for its own: the snapshot behind it, for unpublish and restart reconcile
    assert SnapshotMounts.of(csi.store, mounts.mount_table()).snapshot_id(entry) == snapshot.id  # type: ignore[union-attr]
    assert csi.store.leases() == {"csi:vol-hf": snapshot.id}

    await csi.node.NodeUnpublishVolume(csi.unpublish_request("vol-hf"))
    assert mounts.mounted_at(target) is None and not target.exists()
    assert csi.store.leases() == {}


@pytest.mark.parametrize("repo", ["../etc", "a/b/c", "org--x/y", "x" * 200])
async def test_malformed_hf_repo_is_invalid_argument_naming_the_field(csi: CsiHarness, repo: str) -> None:
    code, details = await status_of(csi.node.NodePublishVolume(csi.publish_request("vol-bad", hfRepo=repo)))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hfRepo" in details
    assert not csi.weight_gets()  # refused before any download
