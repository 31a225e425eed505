"""The daemon process: one event loop hosting the store, fetch engine, API, CSI server, reconcile and config watch.

Start order: store (startup recovery) -> memory tier -> cluster bridge (cluster mode) -> API sockets -> metrics,
peer server -> CSI, DRA -> background tasks. Each part, once started, pushes its stop on one AsyncExitStack, so
SIGTERM/SIGINT (or a failed start) stops them in reverse by construction, after the API stops accepting (listeners
closed, socket file removed): config watch, DRA, CSI, peer server, metrics, the loops, then the downloads parked
(Fetcher.close leaves partial files and journals for the next start to resume) before the API waits out its
requests in progress, then the cluster bridge, memory tier, peers and store. One stop failing does not skip the
others. Exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from weightcache.daemon.api import make_app
from weightcache.daemon.config import Settings, apply_bandwidth, apply_live
from weightcache.daemon.configwatch import ConfigWatcher
from weightcache.daemon.metrics import Metrics
from weightcache.daemon.metrics_server import start_metrics_server
from weightcache.daemon.node import MeteredFetcher, Node, Service
from weightcache.daemon.reconcile import Reconciler
from weightcache.daemon.tasks import Tasks
from weightcache.errors import ConfigError, MemoryTierError, StoreError
from weightcache.listener import ConnectionLimits, GuardedTCPSite
from weightcache.ratelimit import BandwidthLimits
from weightcache.redact_logs import RedactingFormatter
from weightcache.sources import ClientPool
from weightcache.store import Store
from weightcache.unixsock import SocketAccess, claim_socket_path

if TYPE_CHECKING:
    from weightcache.daemon.cluster import Cluster
    from weightcache.dra.server import DraPlugin
    from weightcache.memory import MemoryTier
    from weightcache.peers import PeerSet

log = logging.getLogger(__name__)

SHUTDOWN_GRACE_S = 5.0  # how long a request in progress (a streaming ensure) may take to finish on SIGTERM
TCP_LIMITS = ConnectionLimits()  # the TCP listener's connection cap and header/body timeouts (weightcache/listener.py)


def _warm_s3() -> None:
    """The S3 source's botocore data parsed before the first fetch needs it (sources/s3.py `warm`): off the event
    loop, and a failure costs nothing but the first fetch's time."""
    try:
        from weightcache.sources import s3

        s3.warm()
    except Exception as exc:
        log.info("S3 source not warmed: %s", exc)


class Daemon:
    """`await start()`, then `await stop()`; `serve()` runs both around a stop event."""

    def __init__(self, settings: Settings, *, env: Mapping[str, str] | None = None,
                 flags: Mapping[str, Any] | None = None) -> None:
        self.settings = settings
        self._env, self._flags = env, flags
        self.node: Node | None = None
        self.reconciler: Reconciler | None = None
        self._runner: web.AppRunner | None = None
        self._watcher: ConfigWatcher | None = None
        self._loops = Tasks()  # eternal loops; node.tasks holds the fetches requests started
        self._bound: Path | None = None  # the socket file we created (never remove another daemon's)
        self.tcp_port: int | None = None
        self.metrics_port: int | None = None
        self.peer_port: int | None = None
        self._stack = contextlib.AsyncExitStack()  # each part's stop, pushed as it starts

    async def start(self) -> None:
        """Start everything; on failure, stop what had started and raise."""
        try:
            await self._start()
        except BaseException:
            await self.stop()
            raise

    async def _start(self) -> None:
        s, stack = self.settings, self._stack
        # before the API answers: a fetch asked the moment it does (16 daemons of a bench, a pod already waiting)
        # must not race the warm-up for the CPU, nor find it half done (a thread started after: 2 of 3 runs of
        # the 16-node bench had nodes start their share late and lose it to the next in rank)
        warming = asyncio.ensure_future(asyncio.to_thread(_warm_s3)) \
            if any(where.startswith("s3") for where, _ in s.fetch.endpoints) else None
        kept = s.store
        store = await asyncio.to_thread(Store, kept.root, budget_bytes=kept.disk_budget, set_by="daemon",
                                        min_free_bytes=kept.min_free_bytes, min_free_percent=kept.min_free_percent)
        stack.callback(store.close)
        metrics = Metrics()
        peer_token = _read_token(s.peers.token_file, "peerTokenFile") if s.peers.token_file is not None else None
        bandwidth = BandwidthLimits()  # the node's bytesPerSecond, handed to every fetch and peer read
        apply_bandwidth(bandwidth, s)
        peers = _peer_set(s, peer_token, bandwidth)
        if peers is not None:
            stack.callback(peers.close)
        clients = ClientPool()  # S3 clients kept between fetches, closed after the fetches park
        stack.callback(clients.close)
        fetcher = MeteredFetcher(store, s, metrics, peers, limits=bandwidth, clients=clients)
        node = self.node = Node(s, store, metrics, fetcher, tier=_memory_tier(s), bandwidth=bandwidth)
        stack.push_async_callback(self._close_tier, node)  # the tier then (a reload may have made or dropped one)
        node.store_ready = True
        metrics.watch(node.sample)
        node.cluster = await _cluster(node)
        if node.cluster is not None:
            stack.push_async_callback(asyncio.to_thread, node.cluster.stop)
        self.reconciler = Reconciler(node)
        loop = asyncio.get_running_loop()
        reconciler = self.reconciler

        def kick() -> None:  # from any thread (the ModelCache watch runs in its own)
            loop.call_soon_threadsafe(reconciler.kick)
        node.kick = kick
        if warming is not None:
            await warming
        await self._serve_api(node)
        if s.api.metrics_listen is not None:
            metrics_runner, self.metrics_port = await start_metrics_server(metrics, *s.api.metrics_listen)
            stack.push_async_callback(metrics_runner.cleanup)
        await self._serve_peers(node, peer_token)
        await self._serve_node_services(node)
        self._loops.spawn("reconcile", self.reconciler.run())
        if s.config_path is not None:
            self._watcher = ConfigWatcher(s.config_path, self.apply, env=self._env, flags=self._flags,
                                          on_rejected=lambda _: metrics.reloads.labels("rejected").inc())
            stack.callback(self._watcher.stop)
            await self._watcher.start()
            self._loops.spawn("config-watch", self._watcher.run())
        log.info("weightcache daemon serving on %s (root %s, %s)", s.api.socket, s.store.root,
                 "cluster mode" if node.cluster is not None else "no cluster")

    async def _serve_peers(self, node: Node, peer_token: bytes | None) -> None:
        """This node's blobs to its peers (peerListen), its address told to them, and (in a cluster) discovery."""
        s, stack, store = self.settings, self._stack, node.store
        if s.peers.listen is not None and peer_token is not None:
            from weightcache.peers.server import PeerServer

            inflight = node.fetcher.peers.inflight if node.fetcher.peers is not None else None
            node.peer_server = PeerServer(store.layout.blobs, peer_token, inflight=inflight,
                                          bandwidth=node.bandwidth)
            stack.push_async_callback(node.peer_server.stop)
            self.peer_port = await node.peer_server.start(*s.peers.listen)
        if node.fetcher.peers is not None and self.peer_port is not None and s.peers.listen is not None:
            from weightcache.peers.discovery import advertised_url

            # its rank among the peers spreads the first ranges of nodes started together; static peers too:
            # unset, every node of one image hashed the same host name to the same rank and read the same
            # ranges from the origin first
            env = self._env if self._env is not None else os.environ
            node.fetcher.peers.self_url = advertised_url(s.peers.listen[0], self.peer_port, env)
        if node.cluster is not None and node.fetcher.peers is not None:
            self._start_discovery(node)

    async def _serve_node_services(self, node: Node) -> None:
        """The CSI server and the DRA plugin, as configured."""
        s, stack = self.settings, self._stack
        if (csi := await _serve_csi(node)) is not None:
            assert s.csi.endpoint is not None
            stack.callback(_unlink_socket, Path(s.csi.endpoint.removeprefix("unix://")))
            stack.push_async_callback(csi.stop, SHUTDOWN_GRACE_S)
        if (dra := await _serve_dra(node)) is not None:  # its registration socket goes before CSI's service
            stack.push_async_callback(dra.stop, SHUTDOWN_GRACE_S)

    def _start_discovery(self, node: Node) -> None:
        """In a cluster, peers find each other through ModelCacheNode status (docs/peers.md)."""
        from weightcache.peers.discovery import keep_discovering

        cluster = node.cluster
        assert node.fetcher.peers is not None and cluster is not None
        if self.peer_port is not None and self.settings.peers.listen is not None:
            address = node.fetcher.peers.self_url  # advertised_url, set when the listener started
            if address is None:
                log.warning("peerListen %s:%d is not advertised to other nodes: set POD_IP (downward API) or "
                            "listen on the node's address", *self.settings.peers.listen)
            cluster.advertise_peer(address)
        self._loops.spawn("peer-discovery", keep_discovering(cluster.api_client, cluster.node_name, node.fetcher.peers))

    async def _serve_api(self, node: Node) -> None:
        s = self.settings
        token = _read_token(s.api.tcp.token_file, "tcp.tokenFile") if s.api.tcp is not None else None
        access = SocketAccess.configured(s.api.socket_group)  # ConfigError when the node has no such group
        self._runner = web.AppRunner(make_app(node, token=token, access=access), shutdown_timeout=SHUTDOWN_GRACE_S,
                                     access_log=None, handle_signals=False, **TCP_LIMITS.runner_args())
        self._stack.push_async_callback(self._runner.cleanup)  # waits out requests in progress: after the park
        self._stack.push_async_callback(self._park, node)
        self._stack.push_async_callback(self._loops.stop)
        await self._runner.setup()
        await web.SockSite(self._runner, _bind_unix(s.api.socket, access.gid)).start()
        self._bound = s.api.socket
        if s.api.tcp is not None:
            site = GuardedTCPSite(self._runner, s.api.tcp.host, s.api.tcp.port, limits=TCP_LIMITS)  # timeouts, conn cap
            await site.start()
            self.tcp_port = site.port
            log.info("API also on tcp %s:%d (bearer token required)", s.api.tcp.host, self.tcp_port)

    async def apply(self, new: Settings) -> None:
        """Live reload: apply what can change now; log what waits for a restart."""
        node = self.node
        assert node is not None
        merged, pending = apply_live(self.settings, new)
        apply_bandwidth(node.bandwidth, merged)
        if pending:
            log.warning("config fields %s changed; they take effect at the next restart", ", ".join(sorted(pending)))
        old, self.settings, node.settings = self.settings, merged, merged
        logging.getLogger().setLevel(merged.log.level)
        now, was = merged.store, old.store
        floor_moved = (now.min_free_bytes, now.min_free_percent) != (was.min_free_bytes, was.min_free_percent)
        if now.disk_budget != was.disk_budget or floor_moved:  # kept with the store: every command agrees
            await asyncio.to_thread(node.store.set_limits, budget_bytes=now.disk_budget,
                                    min_free_bytes=now.min_free_bytes, min_free_percent=now.min_free_percent,
                                    set_by="daemon")
        if now.disk_budget != was.disk_budget and now.disk_budget is not None:
            evicted = await asyncio.to_thread(node.store.evict_to, now.disk_budget)
            node.metrics.evictions.labels("budget").inc(len(evicted))
        if floor_moved:
            evicted = await asyncio.to_thread(node.store.restore_floor)
            node.metrics.evictions.labels("budget").inc(len(evicted))
        if merged.memory.budget != old.memory.budget:
            await asyncio.to_thread(self._resize_tier, merged.memory.budget)
        if merged.models.parallel != old.models.parallel:
            node.fetches.set_parallel(merged.models.parallel)
        node.metrics.reloads.labels("applied").inc()
        node.kick()

    def _resize_tier(self, budget: int) -> None:
        node = self.node
        assert node is not None
        if node.tier is None:
            node.tier = _memory_tier(self.settings)
        elif budget <= 0:  # tier off: unlock everything
            node.tier.close()
            node.tier = None
        else:
            try:
                demoted = node.tier.set_budget(budget)  # demotes LRU unpinned models; never silently over budget
            except MemoryTierError as exc:  # pinned models alone exceed it: say so loudly, keep serving
                log.error("%s", exc)
                return
            if demoted:
                log.info("memory budget lowered to %d bytes: demoted %s", budget, ", ".join(demoted))

    async def stop(self) -> None:
        """Stop accepting API requests, then everything started, in reverse (the stack)."""
        if self._runner is not None:
            for site in list(self._runner.sites):  # stop accepting first
                await site.stop()
        if self._bound is not None:
            _unlink_socket(self._bound)
        await self._stack.aclose()
        log.info("weightcache daemon stopped")

    @staticmethod
    async def _park(node: Node) -> None:
        node.fetches.close()  # queued fetches fail, running ones are asked to stop
        node.fetcher.close()  # parks downloads at their next chunk: partials and journals stay
        await node.tasks.stop(grace=SHUTDOWN_GRACE_S)  # their streams get a final line saying so

    @staticmethod
    async def _close_tier(node: Node) -> None:
        if node.tier is not None:
            await asyncio.to_thread(node.tier.close)

    async def serve(self, stop: asyncio.Event) -> None:
        await self.start()
        try:
            await stop.wait()
        finally:
            await self.stop()


def run(settings: Settings, *, env: Mapping[str, str] | None = None, flags: Mapping[str, Any] | None = None) -> int:
    """The `weightcache daemon` process: returns the exit code."""
    setup_logging(settings.log.format, settings.log.level)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await Daemon(settings, env=env, flags=flags).serve(stop)

    try:
        asyncio.run(main())
    except (ConfigError, StoreError) as exc:
        log.error("%s", exc)
        return 2
    return 0


def _bind_unix(path: Path, gid: int | None = None) -> socket.socket:
    """A listening Unix socket with mode 0660 from the start (bound under a umask, not chmod-ed later), of group
    `gid` (socketGroup) when given, so its members can connect; the API checks each peer's credentials too."""
    claim_socket_path(path, change="--socket")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o117)
    try:
        sock.bind(str(path))
    finally:
        os.umask(old)
    if gid is not None:
        os.chown(path, -1, gid)
    os.chmod(path, 0o660)
    sock.listen(128)
    sock.setblocking(False)
    return sock


def _unlink_socket(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _read_token(path: Path, what: str) -> bytes:
    try:
        token = path.read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from exc
    if len(token) < 16:
        raise ConfigError(f"{what} {path} holds fewer than 16 characters; write a long random token "
                          "(for example: openssl rand -hex 32)")
    return token


def _peer_set(settings: Settings, token: bytes | None, limits: BandwidthLimits | None = None) -> PeerSet | None:
    """The configured peers, and those discovered in a cluster later (None without a token: the origin only)."""
    if token is None:
        return None
    from weightcache.peers import PeerClient, PeerSet

    def client(url: str) -> PeerClient:
        return PeerClient(url, token, connect_timeout=fetch.connect_timeout, read_timeout=fetch.read_timeout)

    fetch, peers = settings.fetch, settings.peers
    return PeerSet((client(url) for url in peers.urls), client, ban_s=peers.ban_seconds, limits=limits)


def _memory_tier(settings: Settings) -> MemoryTier | None:
    if settings.memory.budget <= 0:
        return None
    from weightcache.memory import MemoryTier
    tier = MemoryTier(settings.memory.budget)
    try:
        tier.check_limits()
    except MemoryTierError as exc:  # serve from disk meanwhile: each promote fails with its own reason
        log.error("%s", exc)
    return tier


async def _cluster(node: Node) -> Cluster | None:
    from weightcache.daemon.cluster import connect
    return await connect(node)


async def _serve_dra(node: Node) -> DraPlugin | None:
    if node.settings.dra is None:
        return None
    from weightcache.daemon.dra import serve_for_node
    return await serve_for_node(node)


async def _serve_csi(node: Node) -> Service | None:
    s = node.settings
    if s.csi.endpoint is None:
        return None
    from weightcache.daemon.cluster import serve_csi
    return await serve_csi(node)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message (+ exc)."""

    def format(self, record: logging.LogRecord) -> str:
        line = {"time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                + f".{int(record.msecs):03d}Z", "level": record.levelname, "logger": record.name,
                "message": record.getMessage()}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        return json.dumps(line)


def setup_logging(fmt: str, level: str) -> None:
    """Only the process entry point configures handlers (library modules never do)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(RedactingFormatter(JsonFormatter() if fmt == "json" else
                                            logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
