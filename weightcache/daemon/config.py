"""Daemon settings: one YAML file (camelCase, like Kubernetes), overridden by environment, overridden by flags.

    file  ─┐
    env   ─┼─▶ one merged camelCase dict ─▶ parse + validate everything ─▶ Settings (frozen, in groups)
    flags ─┘

The file is flat (`diskBudget: 500Gi`, `peers: [...]`); `Settings` groups its keys by concern (kopf's shape):
`settings.store.disk_budget`, `settings.peers.urls`. Each key is defined once, on its field (`setting`, with the
field's docstring as its documentation): the parser below, docs/config.md's tables and the Helm chart's
values.schema.json are made from those definitions (scripts/gen_config.py; tests/test_daemon_config.py fails when
the committed docs or schema drift from them). Parsing is all-or-nothing, so a live reload either yields a whole
valid Settings or a ConfigError that names the field and says what to write instead.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from weightcache import defaults, engine_cache
from weightcache.errors import ConfigError, InvalidReferenceError
from weightcache.ratelimit import BandwidthLimits
from weightcache.settings import (
    BOOL,
    PATH,
    SECONDS,
    SIZE,
    URL,
    WHOLE,
    FetchSettings,
    Flag,
    Key,
    boolean,
    keys_of,
    merged,
    parse_group,
    reject_unknown,
    seconds,
    setting,
    whole_number,
)
from weightcache.store import floor
from weightcache.store.floor import parse_percent
from weightcache.units import ascii_int, parse_size
from weightcache.uri import ModelRef, parse_ref

_HOST_PORT = {"type": "string", "pattern": r"^.+:[0-9]{1,5}$"}
_GROUP = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")  # a group name as groupadd takes it, or a gid


def _choice(value: Any, what: str, choices: tuple[str, ...], *, upper: bool = False) -> str:
    text = str(value).upper() if upper else str(value).lower()
    if text not in choices:
        raise ConfigError(f"{what}: expected one of {', '.join(choices)}, got {value!r}")
    return text


def _path(value: Any, what: str) -> Path:
    if not isinstance(value, (str, Path)) or not str(value).startswith("/"):
        raise ConfigError(f"{what}: expected an absolute path, got {value!r}")
    return Path(value)


def _host_port(value: Any, what: str) -> tuple[str, int]:
    """`HOST:PORT` (`[::]:9478` for IPv6); port 0 picks a free one."""
    host, sep, port = str(value).rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    number = ascii_int(port)
    if not sep or not host or number is None or number > 65535:
        raise ConfigError(f"{what}: expected HOST:PORT such as 0.0.0.0:9478, got {value!r}")
    return host, number


@dataclass(frozen=True)
class ModelSpec:
    """A model the daemon keeps warm (config `models:` entry)."""

    ref: ModelRef
    tier: str = "disk"  # "disk" or "memory"
    pin: bool = True  # pinned models are never evicted for space

    @property
    def name(self) -> str:
        """Stable name for reconcile bookkeeping: config models are named by their key."""
        return "config/" + self.ref.key


def _model(index: int, entry: Any) -> ModelSpec:
    where = f"models[{index}]"
    if not isinstance(entry, dict) or "source" not in entry:
        raise ConfigError(f"{where}: expected a mapping with at least source: s3://bucket/prefix/")
    reject_unknown(entry, dict.fromkeys(("source", "revision", "include", "exclude", "tier", "pin")), where)
    include, exclude = entry.get("include") or [], entry.get("exclude") or []
    if not all(isinstance(g, str) for g in (*include, *exclude)) or isinstance(include, str) \
            or isinstance(exclude, str):
        raise ConfigError(f"{where}: include and exclude are lists of globs, such as ['*.safetensors']")
    try:
        ref = parse_ref(str(entry["source"]), revision=entry.get("revision") or None,
                        include=include, exclude=exclude)
    except InvalidReferenceError as exc:
        raise ConfigError(f"{where}.source: {exc}") from exc
    tier = _choice(entry.get("tier") or "disk", f"{where}.tier", ("disk", "memory"))
    return ModelSpec(ref, tier, boolean(entry.get("pin", True), f"{where}.pin"))


def _models(value: Any, what: str) -> tuple[ModelSpec, ...]:
    if not isinstance(value, list):
        raise ConfigError(f"{what}: expected a list of {{source, revision, include, exclude, tier, pin}}")
    specs = tuple(_model(i, entry) for i, entry in enumerate(value))
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise ConfigError(f"models[{i}] repeats models[{seen[spec.name]}] ({spec.ref.uri}); keep one entry")
        seen[spec.name] = i
    return specs


@dataclass(frozen=True)
class TcpSettings:
    """Optional TCP listener; it exists only together with a bearer token file."""

    port: int
    token_file: Path
    host: str = "127.0.0.1"


def _tcp(value: Any, what: str) -> TcpSettings:
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: expected {{port: 9477, tokenFile: /etc/weightcache/token}}")
    reject_unknown(value, {"port": None, "tokenFile": None, "host": None}, what)
    if not value.get("tokenFile"):
        raise ConfigError("tcp.tokenFile: the TCP listener needs a bearer token file; "
                          "set tcp.tokenFile or remove tcp to serve only the Unix socket")
    port = whole_number(value.get("port", 0), "tcp.port", 0)
    if port > 65535:
        raise ConfigError(f"tcp.port: {port} is not a port number (0-65535)")
    return TcpSettings(port, _path(value["tokenFile"], "tcp.tokenFile"), str(value.get("host") or "127.0.0.1"))


@dataclass(frozen=True)
class DraSettings:
    """The DRA kubelet plugin (config `dra:`; docs/dra.md). Present = enabled."""

    slots_per_model: int = 8  # devices per cached snapshot: how many claims on the node can hold it at once
    shared: bool | None = None  # one device per snapshot with consumable capacity; None: auto (1.36+ API server)
    cdi_dir: Path = defaults.CDI_DIR
    api_version: str = "v1"  # resource.k8s.io version: v1 (Kubernetes 1.34+) or v1beta2 (1.33)
    publish_seconds: float = 2.0  # how often the store is checked for new or evicted snapshots


def _dra(value: Any, what: str) -> DraSettings | None:
    """`dra: {slotsPerModel: 8, shared: auto, cdiDir: /var/run/cdi, apiVersion: v1, publishSeconds: 2}`;
    `true` (the --dra flag) is the defaults, `false` turns it off."""
    if isinstance(value, (bool, str)):
        return DraSettings() if boolean(value, what) else None
    if not isinstance(value, dict):
        raise ConfigError("dra: expected true, false or a mapping such as {slotsPerModel: 8}")
    reject_unknown(value, dict.fromkeys(("slotsPerModel", "shared", "cdiDir", "apiVersion", "publishSeconds")), what)
    slots = whole_number(value.get("slotsPerModel", 8), "dra.slotsPerModel")
    if slots > 64:
        raise ConfigError(f"dra.slotsPerModel: at most 64 (a ResourceSlice holds 128 devices), got {slots}")
    version = _choice(value.get("apiVersion", "v1"), "dra.apiVersion", ("v1", "v1beta2"))
    try:
        every = float(value.get("publishSeconds", 2.0))
    except (TypeError, ValueError):
        every = -1.0
    if not 0.1 <= every <= 3600:
        raise ConfigError(f"dra.publishSeconds: expected seconds between 0.1 and 3600, got {value['publishSeconds']!r}")
    shared = value.get("shared", "auto")
    return DraSettings(slots, None if shared in ("auto", None) else boolean(shared, "dra.shared"),
                       _path(value.get("cdiDir", defaults.CDI_DIR), "dra.cdiDir"), version, every)


def _peers(value: Any, what: str) -> tuple[str, ...]:
    """A list of peer URLs (a string: one URL, or several separated by commas, as env and flags give them)."""
    from weightcache.peers.client import peer_base_url

    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(u, str) for u in items):
        raise ConfigError(f"{what}: expected a list of http(s)://HOST:PORT, got {type(value).__name__}")
    return tuple(peer_base_url(u) for u in items if u.strip())


def _csi_endpoint(value: Any, what: str) -> str:
    if not isinstance(value, str) or not value.startswith("unix:///"):
        raise ConfigError(f"{what}: expected unix:///path/to/csi.sock, got {value!r}")
    return value


def _group_name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not _GROUP.match(value):
        raise ConfigError(f"{what}: expected the name (or number) of a group on the node, e.g. weightcache; "
                          f"got {str(value)[:40]!r}")
    return value


def _bytes_per_second(value: Any, what: str) -> tuple[tuple[str, int], ...]:
    """`{origin: 200Mi, peers: 1Gi, s3: 100Mi, "s3://bucket": 50Mi}`: bytes per second, 0 for none."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what}: expected a mapping such as {{origin: 200Mi, peers: 1Gi, \"s3://bucket\": 50Mi}}")
    out = []
    for key, rate in value.items():
        key = str(key)
        if key not in ("origin", "peers", "serve") and not re.fullmatch(r"[a-z0-9+.-]+(://[^/\s]+)?", key):
            raise ConfigError(f"{what}.{key}: expected origin, peers, serve, a scheme (s3) or scheme://bucket")
        out.append((key.rstrip("/"), parse_size(rate, f"{what}.{key}")))
    return tuple(sorted(out))


@dataclass(frozen=True)
class StoreSettings:
    """The store on the node's disk (docs/store.md) and how much of the disk the cache may use."""

    root: Path = setting(defaults.ROOT, "root", _path, PATH, env="WEIGHTCACHE_ROOT", flag="--root")
    """Store root: blobs, snapshots, index (layout in `docs/store.md`). Put it on the node's NVMe."""
    disk_budget: int | None = setting(None, "diskBudget", parse_size, SIZE, env="WEIGHTCACHE_DISK_BUDGET",
                                      live=True, shown="none (the disk)")
    """Most bytes the store may use. Past it, least recently used snapshots that are neither pinned nor leased
    are evicted; a fetch that cannot fit fails with `InsufficientSpaceError` (HTTP 507). Lowering it evicts at
    once."""
    min_free_bytes: int = setting(defaults.MIN_FREE_BYTES, "minFreeBytes", parse_size, SIZE, env=floor.ENV_BYTES,
                                  live=True, shown="`64Mi`")
    """With `minFreePercent`, the store's free-space floor: the larger of the two is kept free on the store's
    filesystem. A fetch may not cut into it (`InsufficientSpaceError` before any download), and when anything
    (pods, logs) pushes the disk below it, the store evicts least recently used unpinned, unleased snapshots at
    its next start or config change. Covers the growth of the index, WAL, manifests and journals. The daemon
    keeps its floor and `diskBudget` with the store (`<root>/limits.json`, rewritten on each config change), so
    the `weightcache` CLI, when it uses the store directly, keeps the same ones: its `--min-free-bytes` /
    `--min-free-percent` (and `prefetch --disk-budget`), else these two variables, else what the store keeps,
    else the defaults; a value a command is given is kept for the next ones (weightcache/store/floor.py;
    docs/store.md)."""
    min_free_percent: float = setting(defaults.MIN_FREE_PERCENT, "minFreePercent", parse_percent,
                                      {"type": ["number", "string"], "minimum": 0, "maximum": floor.MAX_PERCENT},
                                      env=floor.ENV_PERCENT, live=True)
    """Percent of the filesystem kept free (0-90). The default keeps the disk above kubelet's default
    `nodefs.available<10%` eviction threshold, so a full cache never makes kubelet evict pods; on a disk of its
    own the store can use `0`."""
    engine_cache_budget: int = setting(engine_cache.NODE_BYTES, "engineCacheBudget", parse_size, SIZE,
                                       env="WEIGHTCACHE_ENGINE_CACHE_BUDGET", shown="`32Gi`")
    """Most bytes every engine cache on the node may hold together (docs/engine-caches.md). A hand-over past it
    evicts the least recently used engine caches no pod uses, never a model; else it is refused (507, exit 5).
    Read by the API's hand-overs and the CSI plugin's read-backs."""
    engine_cache_namespace_budget: int = setting(engine_cache.NAMESPACE_BYTES, "engineCacheNamespaceBudget",
                                                 parse_size, SIZE, env="WEIGHTCACHE_ENGINE_CACHE_NAMESPACE_BUDGET",
                                                 shown="`8Gi`")
    """Most bytes one namespace's engine caches may hold (the admin's count against `engineCacheBudget` only);
    past it the namespace's own least recently used caches make room."""

    @property
    def engine_limits(self) -> engine_cache.EngineCacheLimits:
        """The bounds and budgets of engine caches: handed over through the API, and pods' volumes."""
        return engine_cache.EngineCacheLimits(node_bytes=self.engine_cache_budget,
                                              namespace_bytes=self.engine_cache_namespace_budget)


@dataclass(frozen=True)
class MemorySettings:
    """The memory tier: models kept in locked RAM (docs/operations.md)."""

    budget: int = setting(0, "memoryBudget", parse_size, SIZE, env="WEIGHTCACHE_MEMORY_BUDGET", live=True,
                          shown="`0` (tier off)")
    """Bytes of RAM the memory tier may lock for `tier: memory` models. Locked pages are charged to the daemon's
    cgroup: the DaemonSet's memory limit must be at least this plus headroom, and the container needs `IPC_LOCK`
    (the daemon logs which setting is short at start)."""


_MODEL_SCHEMA = {"type": "array", "items": {
    "type": "object", "additionalProperties": False, "required": ["source"],
    "properties": {"source": {"type": "string", "minLength": 1}, "revision": {"type": ["string", "null"]},
                   "include": {"type": ["array", "null"], "items": {"type": "string"}},
                   "exclude": {"type": ["array", "null"], "items": {"type": "string"}},
                   "tier": {"enum": ["disk", "memory", None]}, "pin": BOOL}}}


@dataclass(frozen=True)
class ModelSettings:
    """Which models the node keeps and may fetch, and how the reconcile loop fetches them."""

    warm: tuple[ModelSpec, ...] = setting((), "models", _models, _MODEL_SCHEMA, live=True)
    """Models this node keeps warm, besides the ModelCaches that select it. Each entry: `source` (required,
    `s3://bucket/prefix/`), `revision`, `include` / `exclude` (lists of globs such as `"*.safetensors"`), `tier`
    (`disk` or `memory`; memory needs `memoryBudget`), `pin` (default `true`: never evicted for space). Removing
    an entry unpins it; the bytes stay as ordinary cache."""
    allow_undeclared: bool | None = setting(None, "allowUndeclaredModels", boolean, BOOL, live=True,
                                            env="WEIGHTCACHE_ALLOW_UNDECLARED_MODELS",
                                            shown="`true` off-cluster, `false` in a cluster")
    """Whether a model that no ModelCache (or `models` entry) declares may be fetched and mounted. In a cluster
    keep it `false`: the node's credentials must not become a way to read any bucket the node can reach."""
    parallel: int = setting(2, "parallelModels", whole_number, WHOLE, env="WEIGHTCACHE_PARALLEL_MODELS", live=True)
    """Models the daemon downloads at once, whoever asked (API, CLI, CSI, reconcile share one queue; one fetch
    per model); the rest wait in order and say so (`queued behind 2 downloads`). Total fetch memory <=
    parallelModels x concurrency x (chunkSize + 1 MiB)."""
    resync_seconds: float = setting(60.0, "resyncSeconds", seconds, SECONDS, live=True)
    """A reconcile pass runs on every change (config, ModelCache, node) and at least this often."""

    def undeclared_allowed(self, *, cluster: bool) -> bool:
        return (not cluster) if self.allow_undeclared is None else self.allow_undeclared


@dataclass(frozen=True)
class ApiSettings:
    """Where the daemon's API listens and who may use it (docs/authorization.md)."""

    socket: Path = setting(defaults.SOCKET, "socket", _path, PATH, env="WEIGHTCACHE_SOCKET", flag="--socket")
    """The API's Unix socket (mode 0660). The CLI uses the daemon when this socket exists. Every request on it is
    checked against the connecting process's kernel credentials (SO_PEERCRED, weightcache/unixsock.py): root
    (uid 0), the daemon's own uid, and members of `socketGroup` are admitted; anyone else (a process of group 0
    included, which the file mode lets connect) gets `403 not_allowed` (the CLI: exit 8) with a message naming
    who may. `/healthz` and `/readyz` answer anyone who can connect."""
    socket_group: str | None = setting(None, "socketGroup", _group_name, {"type": "string",
                                                                         "pattern": _GROUP.pattern})
    """A group (name or number) whose members may use the API socket besides root: the socket is made of that
    group, and a process whose primary or supplementary groups include it is admitted. The daemon refuses to
    start when the node has no such group."""
    tcp: TcpSettings | None = setting(None, "tcp", _tcp, {
        "type": "object", "additionalProperties": False, "required": ["tokenFile"],
        "properties": {"port": {"type": "integer", "minimum": 0, "maximum": 65535}, "tokenFile": PATH,
                       "host": {"type": "string"}}})
    """Optional TCP listener for the same API, e.g. for Prometheus: `{port: 9477, host: 0.0.0.0, tokenFile:
    /etc/weightcache-token/token}`. `tokenFile` is required (at least 16 characters; `openssl rand -hex 32`);
    every request but `/healthz` and `/readyz` needs `Authorization: Bearer <token>`. `host` defaults to
    `127.0.0.1`, `port: 0` picks a free port. Safe to expose inside a cluster: at most 64 connections at once (a
    new one takes the slot of the connection idle between requests the longest, closed without a word as HTTP
    lets a server close an idle keep-alive connection, else of the oldest half-sent request, answered `408`;
    refused at accept only when all 64 carry requests being read or answered), request headers must arrive
    within 10 s and a body within 30 s of its headers (else `408`), a connection idle between requests closes
    after 15 s, and what it refuses is logged at most every 10 s (weightcache/listener.py;
    `scripts/bench_listener.py` measures a slowloris against it)."""
    metrics_listen: tuple[str, int] | None = setting(None, "metricsListen", _host_port, _HOST_PORT,
                                                     env="WEIGHTCACHE_METRICS_LISTEN",
                                                     flag=Flag("--metrics-listen", "HOST:PORT"))
    """`HOST:PORT` (`[::]:9478` for IPv6) of a second TCP listener that serves only `GET /metrics`, without a
    token: every other path is 404, every other method 405, so Prometheus needs no admin credential. The
    DaemonSet uses `0.0.0.0:9478`; `deploy/components/prometheus` scrapes it."""


@dataclass(frozen=True)
class PeerSettings:
    """Fleet fill: this node's daemon and its peers serve each other verified blobs (docs/peers.md)."""

    listen: tuple[str, int] | None = setting(None, "peerListen", _host_port, _HOST_PORT,
                                             env="WEIGHTCACHE_PEER_LISTEN", flag=Flag("--peer-listen", "HOST:PORT"),
                                             shown="none (not served)")
    """`HOST:PORT` serving this node's verified blobs to other daemons: `GET`/`HEAD /v1/blobs/sha256/<hex>` with
    Range, read-only, bearer token from `peerTokenFile` required, at most 8 streams per peer address (fewer
    while many peers ask: docs/peers.md) and 500 MiB/s. Needs `peerTokenFile`."""
    urls: tuple[str, ...] = setting((), "peers", _peers, {"type": ["array", "string"], "items": URL},
                                    env="WEIGHTCACHE_PEERS", flag=Flag("--peer", "URL", repeat=True))
    """Other daemons' peer listeners, a list of `http(s)://HOST:PORT` (no path, no userinfo; in the environment,
    separated by commas). A blob whose sha256 the store itself vouches for (S3 SHA-256 checksum) is read from
    these first, range by range across every peer holding it, then from the origin; every blob is still verified
    before publish. Needs `peerTokenFile`."""
    token_file: Path | None = setting(None, "peerTokenFile", _path, PATH, env="WEIGHTCACHE_PEER_TOKEN_FILE",
                                      flag=Flag("--peer-token-file", "FILE"))
    """The fleet's shared bearer token (at least 16 characters; a Secret mounted on every node). Required by
    `peerListen` and `peers`."""
    ban_seconds: float = setting(600.0, "peerBanSeconds", seconds, SECONDS)
    """How long a peer whose bytes failed verification is skipped; each repeat offence doubles it, up to 24 h
    (docs/peers.md, "Blame and bans")."""


@dataclass(frozen=True)
class LimitSettings:
    """Bandwidth limits (weightcache/ratelimit.py)."""

    bytes_per_second: tuple[tuple[str, int], ...] = setting((), "bytesPerSecond", _bytes_per_second,
                                                            {"type": "object", "additionalProperties": SIZE},
                                                            live=True, shown="`{}`")
    """Bandwidth limits in bytes per second, none by default: `{origin: 200Mi, peers: 1Gi, s3: 100Mi,
    "s3://bucket": 50Mi}`. `origin` caps what this node reads from every origin together, `peers` what it reads
    from peers, `serve` what its peer server sends to all peers together (set it a little below the node's
    uplink where that link is the slow part: docs/peers.md, "Serving below the uplink"); a scheme or
    `scheme://bucket` (the most specific wins) caps that source on top of `origin`. One token bucket per limit
    shared by every fetch worker; a reload changes the rates of reads in flight.
    `weightcache status` (and `-o json`, `bandwidth`) shows the limits a running daemon enforces (its `GET
    /v1/status`), the seconds its workers waited on each, and that they are live; the direct CLI (`prefetch
    --no-daemon`) fetches without them."""


@dataclass(frozen=True)
class CsiSettings:
    """The CSI node plugin (docs/csi.md)."""

    endpoint: str | None = setting(None, "csiEndpoint", _csi_endpoint, {"type": "string", "pattern": "^unix:///"},
                                   env="CSI_ENDPOINT", flag="--csi-endpoint", shown="none (no CSI)")
    """Serve the CSI node plugin on `unix:///path/csi.sock`, sharing the daemon's store, single flight, policy and
    metrics."""
    kubelet_dir: Path = setting(defaults.KUBELET_DIR, "kubeletDir", _path, PATH, env="WEIGHTCACHE_KUBELET_DIR")
    """kubelet's root, where volumes are published (k3s: `/var/lib/rancher/k3s/agent/kubelet`; microk8s:
    `/var/snap/microk8s/common/var/lib/kubelet`)."""


_DRA_SCHEMA = {"type": ["boolean", "string", "object"], "pattern": BOOL["pattern"], "additionalProperties": False,
               "properties": {"slotsPerModel": {"type": "integer", "minimum": 1, "maximum": 64}, "shared": BOOL,
                              "cdiDir": PATH, "apiVersion": {"enum": ["v1", "v1beta2"]},
                              "publishSeconds": {"type": "number", "minimum": 0.1, "maximum": 3600}}}


@dataclass(frozen=True)
class ClusterSettings:
    """This node in its Kubernetes cluster (cluster mode: docs/modelcache.md, docs/startup-taint.md)."""

    node_name: str | None = setting(None, "nodeName", lambda v, w: str(v), {"type": "string"}, env="NODE_NAME",
                                    flag="--node-name", shown="the host name")
    """This node's Kubernetes name: the node labelled `weightcache.io/<model-key>=ready`, the `ModelCacheNode`
    written, the CSI node id. Set it from `spec.nodeName` (the DaemonSet does)."""
    startup_taint_deadline: float = setting(600.0, "startupTaintDeadline", seconds, SECONDS, live=True)
    """Seconds after its Node's `creationTimestamp` when the daemon removes the startup taint
    `weightcache.io/models-pending:NoSchedule` even though a ModelCache marked `warmBeforeSchedulable` is not on
    the node yet, with a Warning Event `StartupTaintDeadline` on the Node (docs/startup-taint.md)."""


@dataclass(frozen=True)
class LogSettings:
    """The daemon's log lines."""

    format: str = setting("text", "logFormat", lambda v, w: _choice(v, w, ("text", "json")),
                          {"enum": ["text", "json"]}, env="WEIGHTCACHE_LOG_FORMAT", flag="--log-format")
    """`text`, or `json` (one object per line: `time`, `level`, `logger`, `message`, `exc`)."""
    level: str = setting("INFO", "logLevel", lambda v, w: _choice(v, w, ("DEBUG", "INFO", "WARNING", "ERROR"),
                                                                 upper=True),
                         {"type": "string", "pattern": "(?i)^(debug|info|warning|error)$"},
                         env="WEIGHTCACHE_LOG_LEVEL", flag="--log-level", live=True, shown="`info`")
    """`debug`, `info`, `warning`, `error`."""


@dataclass(frozen=True)
class Settings:
    """Everything the daemon reads from its configuration, by concern; each group's fields are config keys."""

    store: StoreSettings = field(default_factory=StoreSettings)
    memory: MemorySettings = field(default_factory=MemorySettings)
    fetch: FetchSettings = field(default_factory=FetchSettings)
    models: ModelSettings = field(default_factory=ModelSettings)
    api: ApiSettings = field(default_factory=ApiSettings)
    peers: PeerSettings = field(default_factory=PeerSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    csi: CsiSettings = field(default_factory=CsiSettings)
    dra: DraSettings | None = setting(None, "dra", _dra, _DRA_SCHEMA, flag=Flag("--dra", switch=True),
                                      shown="none (off)")
    """The DRA kubelet plugin `models.weightcache.io` (docs/dra.md): `true`, or `{slotsPerModel: 8, shared: auto,
    cdiDir: /var/run/cdi, apiVersion: v1, publishSeconds: 2}`. `slotsPerModel` (1-64) = claims on the node that
    can hold a cached snapshot at once: that many slot devices, or the `readers` capacity of its one shared
    device; `shared`: `auto` (one shared device with consumable capacity where the API server is 1.36+, slots
    below), `true` (always; 1.34/1.35 need the DRAConsumableCapacity feature gate), `false` (always slots);
    `apiVersion: v1beta2` for Kubernetes 1.33. Needs cluster mode. With the flag and a `dra` mapping in the file,
    the mapping's settings apply."""
    cluster: ClusterSettings = field(default_factory=ClusterSettings)
    log: LogSettings = field(default_factory=LogSettings)
    config_path: Path | None = field(default=None, compare=False)


GROUPS: dict[str, Any] = {f.name: f.default_factory for f in fields(Settings) if f.default_factory is not MISSING}
# every config key -> (its group's attribute on Settings, None for a key of Settings itself; its field; its Key)
KEYS: dict[str, tuple[str | None, str, Key]] = {
    key.name: (group, attr, key) for group, cls in [*GROUPS.items(), (None, Settings)] for attr, key in keys_of(cls)}
ENV = {key.env: name for name, (_, _, key) in KEYS.items() if key.env}  # environment variable -> config key


def load_settings(
    path: str | Path | None = None,
    *,
    env: Mapping[str, str] | None = None,
    flags: Mapping[str, Any] | None = None,
) -> Settings:
    """Read the file (if any), apply env then flags, validate everything; raises ConfigError."""
    env = os.environ if env is None else env
    raw, file = merged(path, env, ENV, None)  # the same merge the CLI's fetch settings come from
    tuned = raw.get("dra")
    raw.update({k: v for k, v in (flags or {}).items() if v is not None})
    if raw.get("dra") is True and isinstance(tuned, dict):  # --dra turns the plugin on; the file's mapping tunes it
        raw["dra"] = tuned
    settings = parse_settings(raw)
    return settings if file is None else replace(settings, config_path=file)


def parse_settings(raw: Mapping[str, Any]) -> Settings:
    """Validate a camelCase mapping into Settings; unknown keys are errors (a typo must not pass silently)."""
    reject_unknown(raw, KEYS, "config")
    settings = parse_group(Settings, raw)
    settings = replace(settings, **{name: parse_group(cls, raw) for name, cls in GROUPS.items()})
    for i, model in enumerate(settings.models.warm):
        if model.tier == "memory" and settings.memory.budget <= 0:
            raise ConfigError(f"models[{i}].tier: memory needs the memory tier; set memoryBudget (e.g. 64Gi) "
                              "or use tier: disk")
    if (settings.peers.listen or settings.peers.urls) and settings.peers.token_file is None:
        raise ConfigError("peerListen and peers need peerTokenFile: the fleet's shared token (for example "
                          "`openssl rand -hex 32` in a Secret mounted on every node); docs/peers.md")
    return settings


def value_of(settings: Settings, name: str) -> Any:
    """The value of config key `name` in `settings`."""
    group, attr, _ = KEYS[name]
    return getattr(settings if group is None else getattr(settings, group), attr)


def apply_live(running: Settings, new: Settings) -> tuple[Settings, set[str]]:
    """`new` with the restart-only keys kept from `running`; also returns those of them that changed."""
    def keep(old: Any, fresh: Any) -> Any:
        return replace(fresh, **{attr: getattr(old, attr) for attr, key in keys_of(fresh) if not key.live})

    merged = keep(running, replace(new, **{g: keep(getattr(running, g), getattr(new, g)) for g in GROUPS}))
    pending = {name for name, (_, _, key) in KEYS.items()
               if not key.live and value_of(running, name) != value_of(new, name)}
    return merged, pending


def apply_bandwidth(limits: BandwidthLimits, settings: Settings) -> None:
    """The daemon's bandwidth limits (weightcache/ratelimit.py) as `settings` say, live: workers waiting on a
    bucket take the new rate within 50 ms."""
    rates = dict(settings.limits.bytes_per_second)
    limits.configure(origin=rates.pop("origin", 0), peers=rates.pop("peers", 0), serve=rates.pop("serve", 0),
                     sources=rates)


def json_schema() -> dict[str, Any]:
    """The config file's JSON Schema (draft 7), one property per key the parser reads, no other key."""
    return {"type": "object", "additionalProperties": False,
            "description": "the daemon's config file (docs/config.md), typed from weightcache/daemon/config.py",
            "properties": {name: dict(key.schema) for name, (_, _, key) in KEYS.items()}}
