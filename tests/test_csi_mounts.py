"""mountinfo parsing, and real read-only bind mounts."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

from tests.fixtures_csi import bind_readonly, needs_root, safe_tmp  # noqa: F401
from weightcache.csi import mounts
from weightcache.errors import MountError

SAMPLE = (
    "22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
    "36 22 254:0 /var/lib/weightcache/snapshots/ab12 "
    "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/my\\040vol/mount "
    "ro,nosuid,nodev,relatime shared:1 master:2 - ext4 /dev/vda rw,discard\n"
    "37 22 0:5 / /dev rw,nosuid - devtmpfs udev rw,size=100k\n"
    "garbage line\n"
)


def test_parse_mountinfo_fields_escapes_and_optional_fields() -> None:
    entries = mounts.parse_mountinfo(SAMPLE)
    assert [e.mount_id for e in entries] == [22, 36, 37]
    bind = entries[1]
    assert bind.mount_point == "/var/lib/kubelet/pods/u/volumes/kubernetes.io~csi/my vol/mount"
    assert bind.root == "/var/lib/weightcache/snapshots/ab12" and bind.device == "254:0"
    assert {"ro", "nosuid", "nodev"} <= bind.options and bind.fstype == "ext4" and bind.source == "/dev/vda"
    assert entries[2].fstype == "devtmpfs"
    assert mounts.mounted_at("/dev", entries) is entries[2]
    assert mounts.mounted_at("/var", entries) is None


@needs_root
def test_bind_readonly_mounts_verifies_and_unmounts(safe_tmp: Path) -> None:
    source = safe_tmp / "snap dir"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"w" * 100)
    target = safe_tmp / "pods" / "u" / "mount"
    entry = bind_readonly(source, target)
    assert entry.mount_point == str(target) and {"ro", "nosuid", "nodev"} <= entry.options
    assert (target / "weights.bin").read_bytes() == b"w" * 100
    with pytest.raises(OSError) as err:
        (target / "weights.bin").write_bytes(b"x")
    assert err.value.errno == errno.EROFS
    assert mounts.unmount(target) == 1
    assert mounts.unmount(target) == 0  # idempotent
    mounts.remove_target(target)
    assert not target.exists() and (source / "weights.bin").exists()


@needs_root
def test_bind_of_missing_source_fails_with_mount_error(safe_tmp: Path) -> None:
    with pytest.raises(MountError) as err:
        bind_readonly(safe_tmp / "nope", safe_tmp / "target")
    assert err.value.errno == errno.ENOENT and "target" in str(err.value)
    assert mounts.mounted_at(safe_tmp / "target") is None


@needs_root
def test_remove_target_never_deletes_contents(safe_tmp: Path) -> None:
    target = safe_tmp / "t"
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(OSError):
        mounts.remove_target(target)
    assert (target / "keep").exists()
