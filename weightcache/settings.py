"""The settings every process that fetches reads the same way: the fetch settings and the node's name.

    file (WEIGHTCACHE_CONFIG or --config) ─┐
    env  (WEIGHTCACHE_CONCURRENCY, ...)   ─┼─▶ one merged camelCase dict (`merged`) ─▶ FetchSettings (frozen)
    flags (--concurrency, ...)            ─┘

The daemon (weightcache/daemon/config.py parses the whole file from the same `merged` dict), the direct CLI
(`prefetch`, `verify --repair`) and the standalone CSI server all build their Fetchers through
`FetchSettings.fetcher`, so WEIGHTCACHE_CONCURRENCY, a config file's `endpoints:` or `--read-timeout` mean the
same thing wherever a fetch starts. Field docs: docs/config.md.
"""

from __future__ import annotations

import difflib
import logging
import os
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache import defaults
from weightcache.errors import ConfigError
from weightcache.redact import redact
from weightcache.units import parse_size
from weightcache.uri import ModelRef

if TYPE_CHECKING:
    from weightcache.fetch import Fetcher
    from weightcache.peers import PeerSet
    from weightcache.ratelimit import BandwidthLimits
    from weightcache.store import Store

log = logging.getLogger(__name__)

# Environment variable -> config key, for the fetch settings (the daemon adds its own: daemon/config.py ENV).
FETCH_ENV = {
    "WEIGHTCACHE_CONCURRENCY": "concurrency",
    "WEIGHTCACHE_CHUNK_SIZE": "chunkSize",
    "WEIGHTCACHE_CONNECT_TIMEOUT": "connectTimeout",
    "WEIGHTCACHE_READ_TIMEOUT": "readTimeout",
    "WEIGHTCACHE_REQUIRE_SOURCE_CHECKSUM": "requireSourceChecksum",
}


@dataclass(frozen=True)
class FetchSettings:
    """How a fetch reads its source: what s3transfer's TransferConfig is to its TransferManager."""

    concurrency: int = defaults.CONCURRENCY  # parallel ranged GETs per fetch
    chunk_size: int = defaults.CHUNK_SIZE
    connect_timeout: float = defaults.CONNECT_TIMEOUT  # seconds to connect to a model source
    read_timeout: float = defaults.READ_TIMEOUT  # seconds a model source may stay silent
    endpoints: tuple[tuple[str, str], ...] = ()  # ("s3" or "s3://bucket", endpoint url), most specific wins
    proxies: tuple[tuple[str, str], ...] = ()  # ("s3" or "s3://bucket", HTTP(S) forward proxy url), the same way
    endpoint_flag: str | None = None  # the command line's --endpoint-url: the command's reference's endpoint
    # refuse a fetch with a file nothing from its source verifies (its check would be "none": docs/fetch.md)
    require_source_checksum: bool = False
    # the daemons that serve verified blobs (docs/peers.md): a running daemon's, not a setting read from a file
    peers: PeerSet | None = field(default=None, compare=False, repr=False)
    # a running daemon's bandwidth limits (bytesPerSecond, weightcache/ratelimit.py), handed to every Fetcher
    limits: BandwidthLimits | None = field(default=None, compare=False, repr=False)

    def endpoint_for(self, ref: ModelRef) -> str | None:
        """The endpoint for a reference: --endpoint-url, whatever the reference's scheme (it overrides the most
        specific entry the table has for it), else `scheme://bucket`, else `scheme`; None = the SDK's default."""
        return self.endpoint_flag or _most_specific(self.endpoints, ref)

    def proxy_for(self, ref: ModelRef) -> str | None:
        """The forward proxy for a reference's source, chosen like its endpoint; None = no proxy of ours."""
        return _most_specific(self.proxies, ref)

    def with_peers(self, peers: PeerSet | None, *, limits: BandwidthLimits | None = None) -> FetchSettings:
        """These settings with the daemon's peer set, so its Fetchers ask peers first, and its bandwidth limits
        (`fetcher` hands both on)."""
        return replace(self, peers=peers, limits=limits)

    def fetcher(self, store: Store, ref: ModelRef | None = None, *, cancel: threading.Event | None = None) -> Fetcher:
        """The one way a Fetcher is configured (the package builds a Fetcher nowhere else). `ref`: the model it is for
        (its endpoint and proxy); None: no endpoint or proxy of ours, for a fetcher that serves references of any
        source (the standalone CSI server takes its endpoint from AWS_ENDPOINT_URL, as the SDK does)."""
        from weightcache.fetch import Fetcher  # the engine sits above its settings

        endpoint = self.endpoint_for(ref) if ref is not None else None
        proxy = self.proxy_for(ref) if ref is not None else None
        return Fetcher(store, concurrency=self.concurrency, chunk_size=self.chunk_size, endpoint_url=endpoint,
                       proxy_url=proxy, connect_timeout=self.connect_timeout, read_timeout=self.read_timeout,
                       cancel=cancel, peers=self.peers, require_source_checksum=self.require_source_checksum,
                       limits=self.limits)


def _most_specific(entries: tuple[tuple[str, str], ...], ref: ModelRef) -> str | None:
    table = dict(entries)
    return table.get(f"{ref.scheme}://{ref.bucket}") or table.get(ref.scheme)


def merged(path: str | Path | None, env: Mapping[str, str], names: Mapping[str, str],
           flags: Mapping[str, Any] | None) -> tuple[dict[str, Any], Path | None]:
    """The file (`path`, else WEIGHTCACHE_CONFIG, else none), then the environment variables in `names`, then the
    flags that are set: one camelCase dict, not yet validated; and the file's path."""
    chosen = path or env.get("WEIGHTCACHE_CONFIG") or None
    raw: dict[str, Any] = read_file(Path(chosen)) if chosen else {}
    raw.update({key: env[name] for name, key in names.items() if env.get(name)})
    raw.update({k: v for k, v in (flags or {}).items() if v is not None})
    return raw, Path(chosen) if chosen else None


def load_fetch_settings(path: str | Path | None = None, *, env: Mapping[str, str] | None = None,
                        flags: Mapping[str, Any] | None = None) -> FetchSettings:
    """The fetch settings from the file, env and flags (flags win). The file's other fields are the daemon's:
    they are left to its reader, so a CLI sharing the daemon's config file is not refused for them."""
    flags = dict(flags or {})
    endpoint_flag = flags.pop(ENDPOINT_FLAG, None)  # a flag only: a file's key of that name is not read
    raw, _ = merged(path, os.environ if env is None else env, FETCH_ENV, flags)
    fetch = parse_fetch(raw)
    if endpoint_flag is None:
        return fetch
    return replace(fetch, endpoint_flag=_http_url("--endpoint-url", endpoint_flag, "use the environment's "
                                                  "credentials (AWS_* or the pod's service account)"))


def parse_fetch(raw: Mapping[str, Any]) -> FetchSettings:
    """The fetch fields of a camelCase mapping, validated; other keys are ignored here."""
    values = {snake: FETCH_PARSERS[key](raw[key]) for key, snake in _FETCH_FIELDS.items() if raw.get(key) is not None}
    return FetchSettings(**values)


def flags_from(args: object) -> dict[str, Any]:
    """The fetch flags a command line set (`--concurrency`, `--chunk-size`, `--connect-timeout`, `--read-timeout`,
    `--endpoint-url`), as config keys; unset ones (None) leave the file's and the environment's values."""
    flags = {key: getattr(args, attr, None) for attr, key in (
        ("concurrency", "concurrency"), ("chunk_size", "chunkSize"), ("connect_timeout", "connectTimeout"),
        ("read_timeout", "readTimeout"))}
    url = getattr(args, "endpoint_url", None)
    if url:  # the endpoint of the command's reference, whatever its scheme; the file's other entries stay
        flags[ENDPOINT_FLAG] = url
    return flags


ENDPOINT_FLAG = "--endpoint-url"  # its key among the flags: no config key (camelCase) can take its place

_warned_hostname = threading.Event()


def node_name(configured: str | None = None) -> str:
    """This node's Kubernetes name: the setting (config nodeName, --node-name), else env NODE_NAME (the pod's
    spec.nodeName), else the host name, with one warning per process (a wrong name labels another node)."""
    name = configured or os.environ.get("NODE_NAME")
    if name:
        return name
    host = socket.gethostname()
    if not _warned_hostname.is_set():
        _warned_hostname.set()
        log.warning("NODE_NAME is not set; using the host name %s as the node name", host)
    return host


# -- the parsers the daemon's reader shares --------------------------------------------------------------------
def read_file(path: Path) -> dict[str, Any]:
    import yaml  # only where a config file is read: 20-30 ms of every CLI start otherwise

    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}; check the path and permissions") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of fields (root: ..., diskBudget: ...)")
    return dict(data)


def reject_unknown(raw: Mapping[str, Any], known: Mapping[str, Any], where: str) -> None:
    for key in raw:
        if key not in known:
            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(known)}"
            raise ConfigError(f"{where}: unknown field {key!r}; {hint}")


def whole_number(what: str, minimum: int) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        try:
            number = int(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: expected a whole number, got {value!r}") from None
        if isinstance(value, bool) or number < minimum:
            raise ConfigError(f"{what}: expected a whole number >= {minimum}, got {value!r}")
        return number
    return parse


def seconds(what: str) -> Callable[[Any], float]:
    def parse(value: Any) -> float:
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{what}: expected seconds, got {value!r}") from None
        if not number > 0 or number == float("inf"):
            raise ConfigError(f"{what}: must be a number of seconds > 0, got {value!r}")
        return number
    return parse


def _endpoints(value: Any) -> tuple[tuple[str, str], ...]:
    """`{s3: {endpointUrl: http://minio:9000}, "s3://special-bucket": {endpointUrl: ...}}`."""
    if not isinstance(value, dict):
        raise ConfigError("endpoints: expected a mapping such as {s3: {endpointUrl: http://minio:9000}}")
    out = []
    for key, entry in value.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"endpoints.{key}: expected a mapping with endpointUrl")
        reject_unknown(entry, {"endpointUrl": None}, f"endpoints.{key}")
        out.append((str(key), _http_url(f"endpoints.{key}.endpointUrl", entry.get("endpointUrl"),
                                        "use the environment's credentials (AWS_* or the pod's service account)")))
    return tuple(out)


def _proxies(value: Any) -> tuple[tuple[str, str], ...]:
    """`{s3: http://127.0.0.1:65001, "s3://special-bucket": ...}`: a forward proxy per scheme or bucket."""
    if not isinstance(value, dict):
        raise ConfigError("proxies: expected a mapping such as {s3: http://127.0.0.1:65001}")
    return tuple((str(key), _http_url(f"proxies.{key}", url, "run the proxy without authentication on the node "
                                                              "(dfdaemon listens on the node)"))
                 for key, url in value.items())


def _http_url(where: str, url: Any, credentials_hint: str) -> str:
    """An http(s) URL without userinfo (credentials never live in the config)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        shown = redact(url) if isinstance(url, str) else url
        raise ConfigError(f"{where}: expected an http(s) URL, got {shown!r}")
    if "@" in url.partition("://")[2].partition("/")[0]:
        raise ConfigError(f"{where}: credentials do not belong in the URL; {credentials_hint}")
    return url


def boolean(what: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "1", "yes", "on"):
            return True
        if text in ("false", "0", "no", "off"):
            return False
        raise ConfigError(f"{what}: expected true or false, got {value!r}")
    return parse


FETCH_PARSERS: dict[str, Callable[[Any], Any]] = {
    "concurrency": whole_number("concurrency", 1),
    "chunkSize": lambda v: max(1, parse_size(v, "chunkSize")),
    "connectTimeout": seconds("connectTimeout"),
    "readTimeout": seconds("readTimeout"),
    "endpoints": _endpoints,
    "proxies": _proxies,
    "requireSourceChecksum": boolean("requireSourceChecksum"),
}
_FETCH_FIELDS = {"concurrency": "concurrency", "chunkSize": "chunk_size", "connectTimeout": "connect_timeout",
                 "readTimeout": "read_timeout", "endpoints": "endpoints", "proxies": "proxies",
                 "requireSourceChecksum": "require_source_checksum"}
