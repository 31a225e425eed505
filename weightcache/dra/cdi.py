"""CDI spec files: how the container runtime puts a prepared model into a container.

One spec file per prepared claim, `<cdi dir>/models.weightcache.io-<claim uid>.json`, kind
`models.weightcache.io/model`, one CDI device per allocated device. Each device's containerEdits bind-mount the
snapshot read-only (`ro, rbind, nosuid, nodev`) and set `WEIGHTCACHE_MODEL_PATH` (or the env name the claim's
config asks for). kubelet hands the runtime the fully qualified ids (`models.weightcache.io/model=<name>`) the
DRA response lists. Files are written whole and renamed into place: a runtime never reads half a spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.dra import CDI_KIND, DRIVER_NAME
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


def spec_path(cdi_dir: Path, claim_uid: str) -> Path:
    return cdi_dir / f"{DRIVER_NAME}-{claim_uid}.json"


def cdi_name(claim_uid: str, device: str) -> str:
    """The CDI device name: unique per claim and device, of the characters CDI allows."""
    return f"{claim_uid}-{device}"


def cdi_id(claim_uid: str, device: str) -> str:
    """The fully qualified CDI device id kubelet passes to the runtime."""
    return f"{CDI_KIND}={cdi_name(claim_uid, device)}"


def build_spec(claim_uid: str, mounts: list[ModelMount]) -> dict[str, Any]:
    return {
        "cdiVersion": CDI_VERSION,
        "kind": CDI_KIND,
        "devices": [{
            "name": cdi_name(claim_uid, m.device),
            "containerEdits": {
                "env": [f"{m.env_name}={m.container_path}"],
                "mounts": [{"hostPath": m.host_path, "containerPath": m.container_path,
                            "options": list(MOUNT_OPTIONS)}],
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
