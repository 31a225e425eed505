"""CSI node plugin: cached models as read-only ephemeral inline volumes (driver `csi.weightcache.io`).

`serve_csi` (server.py) starts the gRPC server the daemon hosts (or `python -m weightcache.csi.server` alone);
node.py and identity.py are the services, mounts.py the bind mounts, targets.py where they may go (kubelet's
volume paths, no symlinks), reconcile.py the volume records and their repair after a restart. Importing the
package loads no gRPC: it holds only the driver's name (lease holders are named in weightcache/store/holders.py).
"""

from weightcache.vocabulary import CSI_DRIVER as DRIVER_NAME

__all__ = ["DRIVER_NAME"]
