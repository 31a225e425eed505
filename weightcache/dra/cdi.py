"""CDI spec files: how the container runtime puts a prepared model into a container.

One spec file per prepared claim, `<cdi dir>/models.weightcache.io-<claim uid>.json`, kind
`models.weightcache.io/model`, one CDI device per allocated device. Each device's containerEdits bind-mount the
snapshot read-only (`ro, rbind, nosuid, nodev`) and set `WEIGHTCACHE_MODEL_PATH` (or the env name the claim's
config asks for); the first device of each request also bind-mounts the request's device metadata file
(weightcache/dra/metadata.py) read-only at its KEP-5304 path. Several claims sharing one device (consumable
capacity) get one spec file each, and a claim holding two shares of one device one CDI device per share
(`<claim uid>-<device>-<share id>`). kubelet hands the runtime the fully qualified ids
(`models.weightcache.io/model=<name>`) the DRA response lists. Files are written whole and renamed into place:
a runtime never reads half a spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.dra import CDI_KIND, DRIVER_NAME
from weightcache.dra.metadata import MOUNT_OPTIONS as METADATA_MOUNT_OPTIONS
from weightcache.store.fsops import Tree

CDI_VERSION = "0.5.0"  # env + mounts need no newer spec; containerd 1.7+ and CRI-O read it
MOUNT_OPTIONS = ("ro", "rbind", "nosuid", "nodev")
ENV_NAME = "WEIGHTCACHE_MODEL_PATH"


@dataclass(frozen=True)
class ModelMount:
    """One allocated device made visible in a container."""

    device: str  # the ResourceSlice device name
    host_path: str  # the snapshot as the host sees it
    container_path: str
    env_name: str = ENV_NAME
    share_id: str = ""  # the allocation's shareID, for a shared device
    metadata: tuple[str, str] | None = None  # (host path, container path) of the request's metadata file


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{DRIVER_NAME}-{claim_uid}.json"


def cdi_name(claim_uid: str, device: str, share_id: str = "") -> str:
    """The CDI device name: unique per claim, device and share, of the characters CDI allows."""
    return f"{claim_uid}-{device}-{share_id}" if share_id else f"{claim_uid}-{device}"


def cdi_id(claim_uid: str, device: str, share_id: str = "") -> str:
    """The fully qualified CDI device id kubelet passes to the runtime."""
    return f"{CDI_KIND}={cdi_name(claim_uid, device, share_id)}"


def _mounts(m: ModelMount) -> list[dict[str, Any]]:
    mounts = [{"hostPath": m.host_path, "containerPath": m.container_path, "options": list(MOUNT_OPTIONS)}]
    if m.metadata is not None:
        mounts.append({"hostPath": m.metadata[0], "containerPath": m.metadata[1],
                       "options": list(METADATA_MOUNT_OPTIONS)})
    return mounts


def build_spec(claim_uid: str, mounts: list[ModelMount]) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [{
            "name": cdi_name(claim_uid, m.device, m.share_id),
            "containerEdits": {
                "env": [f"{m.env_name}={m.container_path}"],
                "mounts": _mounts(m),
            },
        } for m in mounts],
    }


def write_spec(cdi_dir: Path, claim_uid: str, mounts: list[ModelMount]) -> Path:
    path = spec_path(cdi_dir, claim_uid)
    data = json.dumps(build_spec(claim_uid, mounts), indent=2, sort_keys=True).encode() + b"\n"
    # never through a planted symlink; no fsync: /var/run/cdi is a tmpfs, a reboot ends the containers too
    cdi_dir.mkdir(parents=True, exist_ok=True)
    Tree(cdi_dir).write_atomic(path, data, durable=False)
    return path


def remove_spec(cdi_dir: Path, claim_uid: str) -> None:
    Tree(cdi_dir).unlink(spec_path(cdi_dir, claim_uid))
