"""Daemon settings: one YAML file (camelCase, like Kubernetes), overridden by environment, overridden by flags.

    file  ─┐
    env   ─┼─▶ one merged camelCase dict ─▶ parse + validate everything ─▶ Settings (frozen)
    flags ─┘

Parsing is all-or-nothing, so a live reload either yields a whole valid Settings or a ConfigError that names
the field and says what to write instead; the running settings are never half-replaced.
Every field is documented in docs/config.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from weightcache import defaults, engine_cache
from weightcache.errors import ConfigError, InvalidReferenceError
from weightcache.ratelimit import BandwidthLimits
from weightcache.settings import (
    FETCH_ENV,
    FETCH_PARSERS,
    FetchSettings,
    boolean,
    merged,
    reject_unknown,
    seconds,
    whole_number,
)
from weightcache.store import floor
from weightcache.store.floor import parse_percent
from weightcache.units import QUANTITY_PATTERN, ascii_int, parse_size
from weightcache.uri import ModelRef, parse_ref

# Environment variable -> config key. Flags use the same keys (see command.py).
ENV = {
    "WEIGHTCACHE_ROOT": "root",
    "WEIGHTCACHE_DISK_BUDGET": "diskBudget",
    floor.ENV_BYTES: "minFreeBytes",
    floor.ENV_PERCENT: "minFreePercent",
    "WEIGHTCACHE_MEMORY_BUDGET": "memoryBudget",
    "WEIGHTCACHE_ENGINE_CACHE_BUDGET": "engineCacheBudget",
    "WEIGHTCACHE_ENGINE_CACHE_NAMESPACE_BUDGET": "engineCacheNamespaceBudget",
    **FETCH_ENV,
    "WEIGHTCACHE_PARALLEL_MODELS": "parallelModels",
    "WEIGHTCACHE_ALLOW_UNDECLARED_MODELS": "allowUndeclaredModels",
    "WEIGHTCACHE_SOCKET": "socket",
    "WEIGHTCACHE_METRICS_LISTEN": "metricsListen",
    "WEIGHTCACHE_PEER_LISTEN": "peerListen",
    "WEIGHTCACHE_PEERS": "peers",
    "WEIGHTCACHE_PEER_TOKEN_FILE": "peerTokenFile",
    "WEIGHTCACHE_LOG_FORMAT": "logFormat",
    "WEIGHTCACHE_LOG_LEVEL": "logLevel",
    "CSI_ENDPOINT": "csiEndpoint",
    "WEIGHTCACHE_KUBELET_DIR": "kubeletDir",
    "NODE_NAME": "nodeName",
}

# Fields a running daemon can change without a restart (the rest are logged and kept until the next start).
LIVE_FIELDS = frozenset({"disk_budget", "min_free_bytes", "min_free_percent", "memory_budget", "models",
                         "allow_undeclared_models", "log_level", "resync_seconds", "parallel_models",
                         "bytes_per_second", "startup_taint_deadline"})



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


@dataclass(frozen=True)
class TcpSettings:
    """Optional TCP listener; it exists only together with a bearer token file."""

    port: int
    token_file: Path
    host: str = "127.0.0.1"


@dataclass(frozen=True)
class DraSettings:
    """The DRA kubelet plugin (config `dra:`; docs/dra.md). Present = enabled."""

    slots_per_model: int = 8  # devices per cached snapshot: how many claims on the node can hold it at once
    shared: bool | None = None  # one device per snapshot with consumable capacity; None: auto (1.36+ API server)
    cdi_dir: Path = defaults.CDI_DIR
    api_version: str = "v1"  # resource.k8s.io version: v1 (Kubernetes 1.34+) or v1beta2 (1.33)
    publish_seconds: float = 2.0  # how often the store is checked for new or evicted snapshots


@dataclass(frozen=True)
class Settings:
    """Everything the daemon reads from its configuration. Field docs live in docs/config.md."""

    root: Path = defaults.ROOT
    disk_budget: int | None = None  # bytes; None = no budget beyond the disk itself
    min_free_bytes: int = defaults.MIN_FREE_BYTES  # the store's free-space floor is the larger of these two
    min_free_percent: float = defaults.MIN_FREE_PERCENT
    memory_budget: int = 0  # bytes of locked RAM for tier=memory models; 0 = memory tier off
    engine_cache_budget: int = engine_cache.NODE_BYTES  # every engine cache in the store (docs/engine-caches.md)
    engine_cache_namespace_budget: int = engine_cache.NAMESPACE_BYTES  # one namespace's engine caches
    concurrency: int = defaults.CONCURRENCY  # parallel ranged GETs per fetch
    chunk_size: int = defaults.CHUNK_SIZE
    connect_timeout: float = defaults.CONNECT_TIMEOUT  # seconds to connect to a model source
    read_timeout: float = defaults.READ_TIMEOUT  # seconds a model source may stay silent
    parallel_models: int = 2  # models fetched at once by the reconcile loop
    endpoints: tuple[tuple[str, str], ...] = ()  # ("s3" or "s3://bucket", endpoint url), most specific wins
    proxies: tuple[tuple[str, str], ...] = ()  # ("s3" or "s3://bucket", HTTP(S) forward proxy url), the same way
    require_source_checksum: bool = False  # refuse a fetch with a file nothing from its source verifies
    models: tuple[ModelSpec, ...] = ()
    allow_undeclared_models: bool | None = None  # None = auto: true off-cluster, false in-cluster
    socket: Path = defaults.SOCKET
    socket_group: str | None = None  # its members may use the API socket too (weightcache/unixsock.py)
    tcp: TcpSettings | None = None
    metrics_listen: tuple[str, int] | None = None  # (host, port) of the read-only /metrics listener
    peer_listen: tuple[str, int] | None = None  # (host, port) serving this node's blobs to peers (docs/peers.md)
    peers: tuple[str, ...] = ()  # http(s)://HOST:PORT of other daemons' peer listeners
    peer_token_file: Path | None = None  # the fleet's shared bearer token (peerListen and peers need it)
    peer_ban_seconds: float = 600.0  # a peer whose bytes failed verification is skipped this long (doubling)
    # bandwidth limits, bytes/s (0: none): ("origin" | "peers" | "s3" | "s3://bucket", rate); weightcache/ratelimit.py
    bytes_per_second: tuple[tuple[str, int], ...] = ()
    csi_endpoint: str | None = None
    dra: DraSettings | None = None  # None: the DRA plugin is off
    kubelet_dir: Path = defaults.KUBELET_DIR
    node_name: str | None = None
    log_format: str = "text"
    log_level: str = "INFO"
    resync_seconds: float = 60.0  # periodic reconcile even without a change event
    startup_taint_deadline: float = 600.0  # seconds after the Node's creation: the startup taint goes anyway
    config_path: Path | None = field(default=None, compare=False)

    @property
    def engine_limits(self) -> engine_cache.EngineCacheLimits:
        """The bounds and budgets of engine caches: handed over through the API, and pods' volumes."""
        return engine_cache.EngineCacheLimits(node_bytes=self.engine_cache_budget,
                                   namespace_bytes=self.engine_cache_namespace_budget)

    @property
    def fetch(self) -> FetchSettings:
        """The fetch settings, as the CLI and the standalone CSI server read them too (weightcache/settings.py)."""
        return FetchSettings(self.concurrency, self.chunk_size, self.connect_timeout, self.read_timeout,
                             self.endpoints, self.proxies, require_source_checksum=self.require_source_checksum)

    def endpoint_for(self, ref: ModelRef) -> str | None:
        return self.fetch.endpoint_for(ref)

    def proxy_for(self, ref: ModelRef) -> str | None:
        return self.fetch.proxy_for(ref)

    def allow_undeclared(self, *, cluster: bool) -> bool:
        return (not cluster) if self.allow_undeclared_models is None else self.allow_undeclared_models


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
    return settings if file is None else _with_path(settings, file)


def parse_settings(raw: Mapping[str, Any]) -> Settings:
    """Validate a camelCase mapping into Settings; unknown keys are errors (a typo must not pass silently)."""
    reject_unknown(raw, _PARSERS, "config")
    values = {_SNAKE[key]: parser(raw[key]) for key, parser in _PARSERS.items() if raw.get(key) is not None}
    settings = Settings(**values)
    for i, model in enumerate(settings.models):
        if model.tier == "memory" and settings.memory_budget <= 0:
            raise ConfigError(f"models[{i}].tier: memory needs the memory tier; set memoryBudget (e.g. 64Gi) "
                              "or use tier: disk")
    if (settings.peer_listen or settings.peers) and settings.peer_token_file is None:
        raise ConfigError("peerListen and peers need peerTokenFile: the fleet's shared token (for example "
                          "`openssl rand -hex 32` in a Secret mounted on every node); docs/peers.md")
    return settings


def _with_path(settings: Settings, path: Path) -> Settings:
    return Settings(**{f.name: getattr(settings, f.name) for f in fields(settings)} | {"config_path": path})




def _choice(what: str, choices: tuple[str, ...], *, upper: bool = False) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        text = str(value).upper() if upper else str(value).lower()
        if text not in choices:
            raise ConfigError(f"{what}: expected one of {', '.join(choices)}, got {value!r}")
        return text
    return parse


def _path(what: str) -> Callable[[Any], Path]:
    def parse(value: Any) -> Path:
        if not isinstance(value, (str, Path)) or not str(value).startswith("/"):
            raise ConfigError(f"{what}: expected an absolute path, got {value!r}")
        return Path(value)
    return parse


_MODEL_KEYS = {"source": None, "revision": None, "include": None, "exclude": None, "tier": None, "pin": None}


def _model(index: int, entry: Any) -> ModelSpec:
    where = f"models[{index}]"
    if not isinstance(entry, dict) or "source" not in entry:
        raise ConfigError(f"{where}: expected a mapping with at least source: s3://bucket/prefix/")
    reject_unknown(entry, _MODEL_KEYS, where)
    include, exclude = entry.get("include") or [], entry.get("exclude") or []
    if not all(isinstance(g, str) for g in (*include, *exclude)) or isinstance(include, str) \
            or isinstance(exclude, str):
        raise ConfigError(f"{where}: include and exclude are lists of globs, such as ['*.safetensors']")
    try:
        ref = parse_ref(str(entry["source"]), revision=entry.get("revision") or None,
                        include=include, exclude=exclude)
    except InvalidReferenceError as exc:
        raise ConfigError(f"{where}.source: {exc}") from exc
    tier = _choice(f"{where}.tier", ("disk", "memory"))(entry.get("tier") or "disk")
    pin = boolean(f"{where}.pin")(entry.get("pin", True))
    return ModelSpec(ref, tier, pin)


def _models(value: Any) -> tuple[ModelSpec, ...]:
    if not isinstance(value, list):
        raise ConfigError("models: expected a list of {source, revision, include, exclude, tier, pin}")
    specs = tuple(_model(i, entry) for i, entry in enumerate(value))
    seen: dict[str, int] = {}
    for i, spec in enumerate(specs):
        if spec.name in seen:
            raise ConfigError(f"models[{i}] repeats models[{seen[spec.name]}] ({spec.ref.uri}); keep one entry")
        seen[spec.name] = i
    return specs


def _tcp(value: Any) -> TcpSettings:
    if not isinstance(value, dict):
        raise ConfigError("tcp: expected {port: 9477, tokenFile: /etc/weightcache/token}")
    reject_unknown(value, {"port": None, "tokenFile": None, "host": None}, "tcp")
    if not value.get("tokenFile"):
        raise ConfigError("tcp.tokenFile: the TCP listener needs a bearer token file; "
                          "set tcp.tokenFile or remove tcp to serve only the Unix socket")
    port = whole_number("tcp.port", 0)(value.get("port", 0))
    if port > 65535:
        raise ConfigError(f"tcp.port: {port} is not a port number (0-65535)")
    return TcpSettings(port, _path("tcp.tokenFile")(value["tokenFile"]), str(value.get("host") or "127.0.0.1"))


def _dra(value: Any) -> DraSettings | None:
    """`dra: {slotsPerModel: 8, shared: auto, cdiDir: /var/run/cdi, apiVersion: v1, publishSeconds: 2}`;
    `true` (the --dra flag) is the defaults, `false` turns it off."""
    if isinstance(value, (bool, str)):
        return DraSettings() if boolean("dra")(value) else None
    if not isinstance(value, dict):
        raise ConfigError("dra: expected true, false or a mapping such as {slotsPerModel: 8}")
    keys = {"slotsPerModel": None, "shared": None, "cdiDir": None, "apiVersion": None, "publishSeconds": None}
    reject_unknown(value, keys, "dra")
    slots = whole_number("dra.slotsPerModel", 1)(value.get("slotsPerModel", 8))
    if slots > 64:
        raise ConfigError(f"dra.slotsPerModel: at most 64 (a ResourceSlice holds 128 devices), got {slots}")
    version = _choice("dra.apiVersion", ("v1", "v1beta2"))(value.get("apiVersion", "v1"))
    try:
        every = float(value.get("publishSeconds", 2.0))
    except (TypeError, ValueError):
        every = -1.0
    if not 0.1 <= every <= 3600:
        raise ConfigError(f"dra.publishSeconds: expected seconds between 0.1 and 3600, got {value['publishSeconds']!r}")
    shared = value.get("shared", "auto")
    return DraSettings(slots, None if shared in ("auto", None) else boolean("dra.shared")(shared),
                       _path("dra.cdiDir")(value.get("cdiDir", defaults.CDI_DIR)), version, every)


def _optional_bytes(what: str) -> Callable[[Any], int]:
    return lambda value: parse_size(value, what)


def _percent(what: str) -> Callable[[Any], float]:
    return lambda value: parse_percent(value, what)  # the CLI reads the floor the same way (store/floor.py)


def _host_port(what: str, example: str) -> Callable[[Any], tuple[str, int]]:
    """`HOST:PORT` (`[::]:9478` for IPv6); port 0 picks a free one."""
    def parse(value: Any) -> tuple[str, int]:
        host, sep, port = str(value).rpartition(":")
        host = host.removeprefix("[").removesuffix("]")
        number = ascii_int(port)
        if not sep or not host or number is None or number > 65535:
            raise ConfigError(f"{what}: expected HOST:PORT such as {example}, got {value!r}")
        return host, number
    return parse


def _peers(value: Any) -> tuple[str, ...]:
    """A list of peer URLs (a string: one URL, or several separated by commas, as env and flags give them)."""
    from weightcache.peers.client import peer_base_url

    items = value.split(",") if isinstance(value, str) else value
    if not isinstance(items, (list, tuple)) or not all(isinstance(u, str) for u in items):
        raise ConfigError(f"peers: expected a list of http(s)://HOST:PORT, got {type(value).__name__}")
    return tuple(peer_base_url(u) for u in items if u.strip())


def _csi_endpoint(value: Any) -> str:
    if not isinstance(value, str) or not value.startswith("unix:///"):
        raise ConfigError(f"csiEndpoint: expected unix:///path/to/csi.sock, got {value!r}")
    return value


_GROUP = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,31}$")  # a group name as groupadd takes it, or a gid


def _group_name(value: Any) -> str:
    if not isinstance(value, str) or not _GROUP.match(value):
        raise ConfigError(f"socketGroup: expected the name (or number) of a group on the node, e.g. weightcache; "
                          f"got {str(value)[:40]!r}")
    return value


_PARSERS: dict[str, Callable[[Any], Any]] = {
    **FETCH_PARSERS,
    "root": _path("root"),
    "diskBudget": _optional_bytes("diskBudget"),
    "minFreeBytes": _optional_bytes("minFreeBytes"),
    "minFreePercent": _percent("minFreePercent"),
    "memoryBudget": _optional_bytes("memoryBudget"),
    "engineCacheBudget": _optional_bytes("engineCacheBudget"),
    "engineCacheNamespaceBudget": _optional_bytes("engineCacheNamespaceBudget"),
    "parallelModels": whole_number("parallelModels", 1),
    "models": _models,
    "allowUndeclaredModels": boolean("allowUndeclaredModels"),
    "socket": _path("socket"),
    "socketGroup": lambda value: _group_name(value),
    "tcp": _tcp,
    "metricsListen": _host_port("metricsListen", "0.0.0.0:9478"),
    "peerListen": _host_port("peerListen", "0.0.0.0:9479"),
    "peers": _peers,
    "peerTokenFile": _path("peerTokenFile"),
    "peerBanSeconds": seconds("peerBanSeconds"),
    "bytesPerSecond": lambda value: _bytes_per_second(value),
    "csiEndpoint": _csi_endpoint,
    "dra": _dra,
    "kubeletDir": _path("kubeletDir"),
    "nodeName": str,
    "logFormat": _choice("logFormat", ("text", "json")),
    "logLevel": _choice("logLevel", ("DEBUG", "INFO", "WARNING", "ERROR"), upper=True),
    "resyncSeconds": seconds("resyncSeconds"),
    "startupTaintDeadline": seconds("startupTaintDeadline"),
}

# The JSON Schema of each key above: what the Helm chart's values.schema.json types `config` with
# (scripts/gen_chart.py writes it; tests/test_helm_chart.py checks it is current and agrees with the parsers).
# It refuses early, at `helm install`, what the parsers would refuse on the node; the parsers stay the judge.
_SIZE = {"type": ["integer", "string"], "minimum": 0, "pattern": rf"^\s*{QUANTITY_PATTERN}\s*$"}
_SECONDS = {"type": ["number", "string"], "exclusiveMinimum": 0, "pattern": r"^\s*[0-9.eE+-]+\s*$"}
_WHOLE = {"type": ["integer", "string"], "minimum": 1, "pattern": r"^\s*[0-9]+\s*$"}
_PATH = {"type": "string", "pattern": "^/"}
_BOOL = {"type": ["boolean", "string"], "pattern": r"(?i)^\s*(true|1|yes|on|false|0|no|off)\s*$"}
_HOST_PORT = {"type": "string", "pattern": r"^.+:[0-9]{1,5}$"}
_URL = {"type": "string", "pattern": "^https?://"}
_SCHEMA: dict[str, dict[str, Any]] = {
    "concurrency": _WHOLE,
    "chunkSize": _SIZE,
    "connectTimeout": _SECONDS,
    "readTimeout": _SECONDS,
    "endpoints": {"type": "object", "additionalProperties": {
        "type": "object", "additionalProperties": False, "properties": {"endpointUrl": _URL}}},
    "proxies": {"type": "object", "additionalProperties": _URL},
    "requireSourceChecksum": _BOOL,
    "root": _PATH,
    "diskBudget": _SIZE,
    "minFreeBytes": _SIZE,
    "minFreePercent": {"type": ["number", "string"], "minimum": 0, "maximum": floor.MAX_PERCENT},
    "memoryBudget": _SIZE,
    "engineCacheBudget": _SIZE,
    "engineCacheNamespaceBudget": _SIZE,
    "parallelModels": _WHOLE,
    "models": {"type": "array", "items": {
        "type": "object", "additionalProperties": False, "required": ["source"],
        "properties": {"source": {"type": "string", "minLength": 1}, "revision": {"type": ["string", "null"]},
                       "include": {"type": ["array", "null"], "items": {"type": "string"}},
                       "exclude": {"type": ["array", "null"], "items": {"type": "string"}},
                       "tier": {"enum": ["disk", "memory", None]}, "pin": _BOOL}}},
    "allowUndeclaredModels": _BOOL,
    "socket": _PATH,
    "socketGroup": {"type": "string", "pattern": _GROUP.pattern},
    "tcp": {"type": "object", "additionalProperties": False, "required": ["tokenFile"],
            "properties": {"port": {"type": "integer", "minimum": 0, "maximum": 65535}, "tokenFile": _PATH,
                           "host": {"type": "string"}}},
    "metricsListen": _HOST_PORT,
    "peerListen": _HOST_PORT,
    "peers": {"type": ["array", "string"], "items": _URL},
    "peerTokenFile": _PATH,
    "peerBanSeconds": _SECONDS,
    "bytesPerSecond": {"type": "object", "additionalProperties": _SIZE},
    "csiEndpoint": {"type": "string", "pattern": "^unix:///"},
    "dra": {"type": ["boolean", "string", "object"], "pattern": _BOOL["pattern"], "additionalProperties": False,
            "properties": {"slotsPerModel": {"type": "integer", "minimum": 1, "maximum": 64}, "shared": _BOOL,
                           "cdiDir": _PATH, "apiVersion": {"enum": ["v1", "v1beta2"]},
                           "publishSeconds": {"type": "number", "minimum": 0.1, "maximum": 3600}}},
    "kubeletDir": _PATH,
    "nodeName": {"type": "string"},
    "logFormat": {"enum": ["text", "json"]},
    "logLevel": {"type": "string", "pattern": "(?i)^(debug|info|warning|error)$"},
    "resyncSeconds": _SECONDS,
    "startupTaintDeadline": _SECONDS,
}


def json_schema() -> dict[str, Any]:
    """The config file's JSON Schema (draft 7), one property per key the parsers read, no other key."""
    untyped = sorted(set(_PARSERS) - set(_SCHEMA))
    if untyped:
        raise ConfigError(f"config keys without a JSON Schema in weightcache/daemon/config.py _SCHEMA: {untyped}")
    return {"type": "object", "additionalProperties": False,
            "description": "the daemon's config file (docs/config.md), typed from weightcache/daemon/config.py",
            "properties": {key: _SCHEMA[key] for key in _PARSERS}}

_SNAKE = {key: re.sub(r"(?<!^)(?=[A-Z])", "_", key).lower() for key in _PARSERS}


def changed_fields(old: Settings, new: Settings) -> set[str]:
    return {f.name for f in fields(Settings) if f.compare and getattr(old, f.name) != getattr(new, f.name)}


def apply_live(running: Settings, new: Settings) -> tuple[Settings, set[str]]:
    """New settings with restart-only fields kept from `running`; also returns those pending fields."""
    pending = changed_fields(running, new) - LIVE_FIELDS
    kept = {name: getattr(running, name) for name in pending}
    merged = Settings(**{f.name: kept.get(f.name, getattr(new, f.name)) for f in fields(Settings)})
    return merged, pending


def apply_bandwidth(limits: BandwidthLimits, settings: Settings) -> None:
    """The daemon's bandwidth limits (weightcache/ratelimit.py) as `settings` say, live: workers waiting on a
    bucket take the new rate within 50 ms."""
    rates = dict(settings.bytes_per_second)
    limits.configure(origin=rates.pop("origin", 0), peers=rates.pop("peers", 0), sources=rates)


def _bytes_per_second(value: Any) -> tuple[tuple[str, int], ...]:
    """`{origin: 200Mi, peers: 1Gi, s3: 100Mi, "s3://bucket": 50Mi}`: bytes per second, 0 for none."""
    if not isinstance(value, Mapping):
        raise ConfigError("bytesPerSecond: expected a mapping such as {origin: 200Mi, peers: 1Gi, "
                          "\"s3://bucket\": 50Mi}")
    out = []
    for key, rate in value.items():
        key = str(key)
        if key not in ("origin", "peers") and not re.fullmatch(r"[a-z0-9+.-]+(://[^/\s]+)?", key):
            raise ConfigError(f"bytesPerSecond.{key}: expected origin, peers, a scheme (s3) or scheme://bucket")
        out.append((key.rstrip("/"), parse_size(rate, f"bytesPerSecond.{key}")))
    return tuple(sorted(out))
