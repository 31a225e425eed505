"""The CSI gRPC server (grpc.aio) on a Unix socket, hosting the Identity and Node services.

The daemon calls `serve_csi` on its own event loop when `--csi-endpoint` is given. Running this module
(`python -m weightcache.csi.server --root DIR --endpoint unix:///csi/csi.sock`) serves CSI alone, for tests
and for debugging on a node.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc

from weightcache import defaults, engine_cache
from weightcache.access import Authority
from weightcache.csi._pb import csi_pb2_grpc
from weightcache.csi.identity import IdentityServicer
from weightcache.csi.node import CSI_TIMEOUT_S, NodeServicer
from weightcache.csi.reconcile import VolumeBook, reconcile
from weightcache.csi.telemetry import ObserveCompile, PodEvent
from weightcache.errors import ConfigError, StoreError
from weightcache.fetch_queue import FetchQueue
from weightcache.memory import MemoryTier
from weightcache.redact_logs import redact_log_handlers
from weightcache.settings import load_fetch_settings, node_name
from weightcache.sources import ClientPool
from weightcache.store import Store
from weightcache.unixsock import claim_socket_path

logger = logging.getLogger(__name__)


def socket_path(endpoint: str) -> Path:
    """`unix:///csi/csi.sock` (or a bare absolute path) -> /csi/csi.sock."""
    path = endpoint.removeprefix("unix://")
    if not path.startswith("/") or "://" in path:
        raise ConfigError(f"CSI endpoint {endpoint!r} must look like unix:///csi/csi.sock (an absolute socket path)")
    return Path(path)


def check_store(store: Store) -> None:
    """Raise when the store cannot serve volumes: a directory the plugin mounts from or leases in is gone (its
    hostPath lost its contents), or its leases cannot be read."""
    for directory in (store.layout.snapshots, store.layout.leases):
        if not directory.is_dir():
            raise StoreError(f"{directory} is missing")
    store.leases()


async def serve_csi(endpoint: str, *, store: Store, fetches: FetchQueue, node_id: str, authority: Authority,
                    publish_timeout: float = CSI_TIMEOUT_S, kubelet_dir: str | Path = defaults.KUBELET_DIR,
                    tier: MemoryTier | None = None,
                    observe: Callable[[str, float, str], None] | None = None,
                    observe_stage: Callable[[str, float, str], None] | None = None,
                    engine_limits: engine_cache.EngineCacheLimits | None = None,
                    pod_event: PodEvent | None = None, observe_compile: ObserveCompile | None = None,
                    on_adapters: Callable[[], None] = lambda: None) -> grpc.aio.Server:
    """Reconcile leases with the mount table, start serving CSI on `endpoint` and resume filling the streaming
    views a restart interrupted; the caller stops the server.

    Models come through `fetches` (the daemon's one fetch queue); `tier` is the daemon's memory tier (None: off):
    volumes with `tier: memory` are made resident in it; `observe(method, seconds, code)` hears every call;
    `observe_stage(stage, seconds, cache)` each pod's cold-start stages, `pod_event` writes them as Events on the
    pod (must not block), `observe_compile(engine, result)` hears each pod's compile-cache result
    (csi/telemetry.py);
    `engine_limits`: the bounds and budgets of pods' engine caches (docs/engine-caches.md); `on_adapters()` hears
    of each adapter directory published (the daemon's reconcile then fetches its adapters, csi/adapters.py)."""
    if not node_id:
        raise ConfigError("the CSI node id is empty; set NODE_NAME (from the pod's spec.nodeName) or --node-name")
    path = socket_path(endpoint)
    book = VolumeBook(store.root)
    pool = ThreadPoolExecutor(4, thread_name_prefix="wc-csi")  # CSI's blocking work never waits behind others'
    await asyncio.get_running_loop().run_in_executor(
        pool, functools.partial(reconcile, store, book, kubelet_dir=kubelet_dir))
    server = grpc.aio.server()
    probe_pool = ThreadPoolExecutor(1, thread_name_prefix="wc-csi-probe")  # liveness never queues behind mounts
    identity = IdentityServicer(functools.partial(check_store, store), probe_pool)
    csi_pb2_grpc.add_IdentityServicer_to_server(identity, server)  # type: ignore[no-untyped-call]
    node = NodeServicer(store, fetches, node_id=node_id, authority=authority, kubelet_dir=kubelet_dir,
                        publish_timeout=publish_timeout, book=book, tier=tier, pool=pool, observe=observe,
                        observe_stage=observe_stage, engine_limits=engine_limits, pod_event=pod_event,
                        observe_compile=observe_compile, on_adapters=on_adapters)
    csi_pb2_grpc.add_NodeServicer_to_server(node, server)  # type: ignore[no-untyped-call]
    claim_socket_path(path, change="--csi-endpoint")  # kubelet reconnects to the new socket
    server.add_insecure_port(f"unix://{path}")
    await server.start()
    os.chmod(path, 0o660)
    await node.resume_streams()  # streaming views a restart left half-filled (docs/streaming-pods.md)
    logger.info("CSI driver serving on unix://%s for node %s", path, node_id)
    return server


async def _main(args: argparse.Namespace) -> None:
    store = Store(args.root)
    # the fetch settings the daemon and the CLI read (WEIGHTCACHE_CONFIG, WEIGHTCACHE_CONCURRENCY, ...)
    clients = ClientPool()  # S3 clients kept between fetches
    fetcher = dataclasses.replace(load_fetch_settings(), clients=clients).fetcher(store)
    fetches = FetchQueue(fetcher)
    authority = Authority(allow_undeclared=lambda: bool(args.allow_undeclared),  # no cluster: the flag decides
                          forbidden_paths=(args.kubelet_dir, args.root))
    server = await serve_csi(args.endpoint, store=store, fetches=fetches, node_id=node_name(args.node_name),
                             authority=authority,
                             publish_timeout=args.publish_timeout, kubelet_dir=args.kubelet_dir)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    await server.stop(grace=5)
    fetches.close()
    fetcher.close()
    clients.close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Serve the weightcache CSI node plugin alone.")
    parser.add_argument("--root", default=str(defaults.root()))
    parser.add_argument("--endpoint", default=os.environ.get("CSI_ENDPOINT", "unix:///csi/csi.sock"))
    parser.add_argument("--node-name", help="this node's Kubernetes name (default: env NODE_NAME, else the host name)")
    parser.add_argument("--kubelet-dir", default=os.environ.get("WEIGHTCACHE_KUBELET_DIR", str(defaults.KUBELET_DIR)))
    parser.add_argument("--publish-timeout", type=float, default=CSI_TIMEOUT_S,
                        help="how long a publish waits for a download when the call has no deadline")
    parser.add_argument("--allow-undeclared", action="store_true", help="allow every model (no cluster policy)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    redact_log_handlers()
    asyncio.run(_main(args))


if __name__ == "__main__":
    main()
