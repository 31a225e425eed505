"""The CSI gRPC server (grpc.aio) on a Unix socket, hosting the Identity and Node services.

The daemon calls `serve_csi` on its own event loop when `--csi-endpoint` is given. Running this module
(`python -m weightcache.csi.server --root DIR --endpoint unix:///csi/csi.sock`) serves CSI alone, for tests
and for debugging on a node.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import stat
from pathlib import Path

import grpc

from weightcache import defaults
from weightcache.csi._pb import csi_pb2_grpc
from weightcache.csi.identity import IdentityServicer
from weightcache.csi.node import NodeServicer, Policy
from weightcache.csi.reconcile import VolumeBook, reconcile
from weightcache.errors import ConfigError
from weightcache.fetch import Fetcher
from weightcache.memory import MemoryTier
from weightcache.store import Store

logger = logging.getLogger(__name__)

def socket_path(endpoint: str) -> Path:
    """`unix:///csi/csi.sock` (or a bare absolute path) -> /csi/csi.sock."""
    path = endpoint.removeprefix("unix://")
    if not path.startswith("/") or "://" in path:
        raise ConfigError(f"CSI endpoint {endpoint!r} must look like unix:///csi/csi.sock (an absolute socket path)")
    return Path(path)


def _clear_stale_socket(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        mode = path.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise ConfigError(f"{path} exists and is not a socket; remove it or choose another --csi-endpoint")
    path.unlink()  # left by a killed plugin; kubelet reconnects to the new one


async def serve_csi(endpoint: str, *, store: Store, fetcher: Fetcher, node_id: str, policy: Policy,
                    publish_timeout: float = 20.0, kubelet_dir: str | Path = defaults.KUBELET_DIR,
                    tier: MemoryTier | None = None) -> grpc.aio.Server:
    """Reconcile leases with the mount table, then start serving CSI on `endpoint`; the caller stops the server.

    `tier` is the daemon's memory tier (None: off); volumes with `tier: memory` are made resident in it."""
    if not node_id:
        raise ConfigError("the CSI node id is empty; set NODE_NAME (from the pod's spec.nodeName) or --node-name")
    path = socket_path(endpoint)
    book = VolumeBook(store.root)
    await asyncio.to_thread(reconcile, store, book, kubelet_dir=kubelet_dir)
    server = grpc.aio.server()
    csi_pb2_grpc.add_IdentityServicer_to_server(IdentityServicer(store.leases), server)
    csi_pb2_grpc.add_NodeServicer_to_server(
        NodeServicer(store, fetcher, node_id=node_id, policy=policy, publish_timeout=publish_timeout, book=book,
                     tier=tier),
        server)
    _clear_stale_socket(path)
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    os.chmod(path, 0o660)
    logger.info("CSI driver serving on unix://%s for node %s", path, node_id)
    return server


async def _main(args: argparse.Namespace) -> None:
    from weightcache.policy import Decision, decide

    store = Store(args.root)
    fetcher = Fetcher(store)

    def policy(uri: str, namespace: str) -> Decision:  # no cluster here: the flag alone decides
        return decide(uri, namespace, [], allow_undeclared=args.allow_undeclared)

    server = await serve_csi(args.endpoint, store=store, fetcher=fetcher, node_id=args.node_name, policy=policy,
                             publish_timeout=args.publish_timeout, kubelet_dir=args.kubelet_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=5)
    fetcher.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the weightcache CSI node plugin alone.")
    parser.add_argument("--root", default=str(defaults.root()))
    parser.add_argument("--endpoint", default=os.environ.get("CSI_ENDPOINT", "unix:///csi/csi.sock"))
    parser.add_argument("--node-name", default=os.environ.get("NODE_NAME", ""))
    parser.add_argument("--kubelet-dir", default=str(defaults.KUBELET_DIR))
    parser.add_argument("--publish-timeout", type=float, default=20.0)
    parser.add_argument("--allow-undeclared", action="store_true", help="allow every model (no cluster policy)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
