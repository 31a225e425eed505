"""CSI node plugin: cached models as read-only ephemeral inline volumes (driver `csi.weightcache.io`).

`serve_csi` (server.py) starts the gRPC server the daemon hosts; node.py and identity.py are the services,
mounts.py the bind mounts, targets.py where they may go (kubelet's volume paths, no symlinks), reconcile.py the
volume records and their repair after a restart. Names are imported lazily, so importing the package loads no
gRPC (lease holders are named and described in weightcache/store/holders.py).
"""

from __future__ import annotations

import importlib
from typing import Any

from weightcache.vocabulary import CSI_DRIVER as DRIVER_NAME

_LAZY = {"serve_csi": "server", "holder_for": "reconcile"}
__all__ = ["DRIVER_NAME", *_LAZY]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
