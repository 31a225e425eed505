"""Default places and sizes, written down once; the CLI, daemon, CSI plugin and docs/config.md use these."""

from __future__ import annotations

import os
from pathlib import Path

ROOT = Path("/var/lib/weightcache")  # the store (env WEIGHTCACHE_ROOT)
SOCKET = Path("/run/weightcache/weightcache.sock")  # the daemon's API (env WEIGHTCACHE_SOCKET)
KUBELET_DIR = Path("/var/lib/kubelet")  # where kubelet publishes volumes (k3s, microk8s differ)
CDI_DIR = Path("/var/run/cdi")  # where the container runtime reads CDI specs (DRA)
CHUNK_SIZE = 16 << 20  # files up to this are read whole (no journal); the unit requests are sized in
CONCURRENCY = 8  # parallel ranged reads per fetch
CONNECT_TIMEOUT = 5.0  # seconds to open a connection to a model source
READ_TIMEOUT = 10.0  # seconds a source may stay silent; 5 attempts keep a blackholed endpoint under 60 s
# The store's free-space floor is the larger of these: it keeps the filesystem above kubelet's default
# `nodefs.available<10%` eviction threshold (1% margin) and leaves room for the index, WAL and journals to grow.
MIN_FREE_PERCENT = 11.0
MIN_FREE_BYTES = 64 << 20


def root() -> Path:
    """WEIGHTCACHE_ROOT, else /var/lib/weightcache."""
    return Path(os.environ.get("WEIGHTCACHE_ROOT") or ROOT)


def socket() -> Path:
    """WEIGHTCACHE_SOCKET, else /run/weightcache/weightcache.sock."""
    return Path(os.environ.get("WEIGHTCACHE_SOCKET") or SOCKET)
