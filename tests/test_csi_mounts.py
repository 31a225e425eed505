"""mountinfo parsing, and real read-only bind mounts."""

from __future__ import annotations

import errno
import subprocess
import sys
from pathlib import Path

import pytest

from tests.fixtures_csi import bind_readonly, needs_root
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


# Run in a child mount namespace whose copy of the shared parent is a peer of ours (`--propagation unchanged`),
# as the daemon's container is with its Bidirectional kubelet mount: what the host sees is what propagated.
_PUBLISH_IN_CHILD_NS = """
import sys
from pathlib import Path
from tests.fixtures_csi import bind_readonly
bind_readonly(sys.argv[1], sys.argv[2], new_api=sys.argv[3] == "new", staging=Path(sys.argv[4]))
"""


@needs_root
@pytest.mark.parametrize("api", ["new", "staged"])
def test_bind_is_readonly_nosuid_nodev_in_the_namespaces_it_propagates_to(safe_tmp: Path, api: str) -> None:
    shared = safe_tmp / "kubelet"
    shared.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "kubelet-test", str(shared)], check=True)
    subprocess.run(["mount", "--make-shared", str(shared)], check=True)
    source = safe_tmp / "snapshot"
    source.mkdir()
    (source / "weights.bin").write_bytes(b"w" * 10)
    target = shared / "pods" / "u" / "mount"
    subprocess.run(["unshare", "-m", "--propagation", "unchanged", sys.executable, "-c", _PUBLISH_IN_CHILD_NS,
                    str(source), str(target), api, str(safe_tmp / "staging")],
                   check=True, cwd=Path(__file__).parent.parent)
    entry = mounts.mounted_at(target)  # this test's namespace plays the host
    assert entry is not None, "the bind did not propagate out of the daemon's namespace"
    assert {"ro", "nosuid", "nodev"} <= entry.options, f"the host sees {sorted(entry.options)}"
    with pytest.raises(OSError) as err:
        (target / "weights.bin").write_bytes(b"x")
    assert err.value.errno == errno.EROFS
    assert mounts.mounted_at(safe_tmp / "staging") is None or not list((safe_tmp / "staging").iterdir())
