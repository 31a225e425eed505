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

import argparse
import functools
import logging
import os
import re
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from weightcache import defaults
from weightcache.errors import ConfigError
from weightcache.redact import redact
from weightcache.units import QUANTITY_PATTERN, parse_size
from weightcache.uri import ModelRef

if TYPE_CHECKING:
    from weightcache.fetch import Fetcher
    from weightcache.peers import PeerSet
    from weightcache.ratelimit import BandwidthLimits
    from weightcache.sources import ClientPool
    from weightcache.store import Store

log = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Key:
    """One config key, defined once on the settings field it fills (`setting`): its camelCase name in the file,
    its environment variable and flag, its parser and JSON Schema, and whether a running daemon applies it live.
    The parser, docs/config.md's tables and the Helm chart's values.schema.json are all made from these
    (scripts/gen_config.py); the field's docstring is its documentation."""

    name: str
    parse: Callable[[Any, str], Any]  # (value, the key's name for errors) -> the field's value; raises ConfigError
    schema: Mapping[str, Any]
    env: str | None = None
    flag: Flag | None = None
    live: bool = False
    shown: str | None = None  # the default's cell in docs/config.md (markdown), where the value says too little


@dataclass(frozen=True)
class Flag:
    """A key's command-line flag. `weightcache daemon` declares one for each (weightcache/daemon/command.py), and
    hands its text to the key's parser, as it does the key's environment variable."""

    name: str  # --peer-listen
    metavar: str | None = None
    repeat: bool = False  # each use adds one value (--peer URL --peer URL)
    switch: bool = False  # takes no value and means `true`
    daemon: bool = True  # False: only the direct CLI's fetch commands take it (cli.py)

    def __str__(self) -> str:
        """Its cell in docs/config.md."""
        if self.repeat:
            return f"`{self.name} {self.metavar}` (repeatable)"
        return f"`{self.name}`" + (" (= `true`)" if self.switch else "" if self.daemon else " (CLI)")


def setting(default: Any, name: str, parse: Callable[[Any, str], Any], schema: Mapping[str, Any], *,
            env: str | None = None, flag: str | Flag | None = None, live: bool = False,
            shown: str | None = None) -> Any:
    """A settings field that a config key fills (see `Key`); `flag`: a Flag, or its name."""
    flag = Flag(flag) if isinstance(flag, str) else flag
    return field(default=default, metadata={"key": Key(name, parse, schema, env, flag, live, shown)})


def keys_of(group: Any) -> list[tuple[str, Key]]:
    """(attribute, Key) of each of a settings group's fields that a config key fills, in definition order."""
    return [(f.name, f.metadata["key"]) for f in fields(group) if "key" in f.metadata]


def docs_of(group: type) -> dict[str, str]:
    """Each field's docstring (the string right after its annotated assignment), whitespace folded: the key's
    documentation, read from the source (docs/config.md's tables and the daemon's --help show it)."""
    import ast
    import inspect

    body = ast.parse(inspect.getsource(group)).body[0]
    assert isinstance(body, ast.ClassDef)
    return {stmt.target.id: " ".join(after.value.value.split())
            for stmt, after in zip(body.body, body.body[1:], strict=False)
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


def parse_group(group: Callable[..., T], raw: Mapping[str, Any]) -> T:
    """A group's fields from a camelCase mapping (the keys that are absent or null keep their defaults)."""
    return group(**{attr: key.parse(raw[key.name], key.name) for attr, key in keys_of(group)
                    if raw.get(key.name) is not None})


# The JSON Schema of each kind of value (values.schema.json types the chart's `config` with them): it refuses
# early, at `helm install`, what the parsers would refuse on the node; the parsers stay the judge.
SIZE = {"type": ["integer", "string"], "minimum": 0, "pattern": rf"^\s*{QUANTITY_PATTERN}\s*$"}
SECONDS = {"type": ["number", "string"], "exclusiveMinimum": 0, "pattern": r"^\s*[0-9.eE+-]+\s*$"}
WHOLE = {"type": ["integer", "string"], "minimum": 1, "pattern": r"^\s*[0-9]+\s*$"}
PATH = {"type": "string", "pattern": "^/"}
BOOL = {"type": ["boolean", "string"], "pattern": r"(?i)^\s*(true|1|yes|on|false|0|no|off)\s*$"}
URL = {"type": "string", "pattern": "^https?://"}


def whole_number(value: Any, what: str, minimum: int = 1) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected a whole number, got {value!r}") from None
    if isinstance(value, bool) or number < minimum:
        raise ConfigError(f"{what}: expected a whole number >= {minimum}, got {value!r}")
    return number


def seconds(value: Any, what: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what}: expected seconds, got {value!r}") from None
    if not number > 0 or number == float("inf"):
        raise ConfigError(f"{what}: must be a number of seconds > 0, got {value!r}")
    return number


def boolean(value: Any, what: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{what}: expected true or false, got {value!r}")


#: Where the endpoint of each scheme but s3 is set: only the S3 source takes an endpoint URL (botocore's
#: `endpoint_url`), so `--endpoint-url` or an `endpoints` entry for another scheme would be silently dropped (a
#: gs:// fetch with `--endpoint-url` went to STORAGE_EMULATOR_HOST's server, or Google's, and exited 0).
OTHER_ENDPOINTS = {
    "gs": "STORAGE_EMULATOR_HOST (gcsfs)",
    "az": "AZURE_STORAGE_CONNECTION_STRING's BlobEndpoint or AZURE_STORAGE_ACCOUNT_NAME (adlfs)",
    "hf": "HF_ENDPOINT",
}


def _s3_only(scheme: str, what: str) -> None:
    if scheme != "s3":
        where = OTHER_ENDPOINTS.get(scheme, f"the {scheme}:// reference itself (it names its server)")
        raise ConfigError(f"{what}: an endpoint URL applies to s3:// only, and {scheme}:// would not use it; "
                          f"{scheme}:// takes its endpoint from {where}")


def _endpoints(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    """`{s3: {endpointUrl: http://minio:9000}, "s3://special-bucket": {endpointUrl: ...}}`: s3 only."""
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: expected a mapping such as {{s3: {{endpointUrl: http://minio:9000}}}}")
    out = []
    for key, entry in value.items():
        _s3_only(str(key).partition("://")[0], f"{what}.{key}")
        if not isinstance(entry, dict):
            raise ConfigError(f"{what}.{key}: expected a mapping with endpointUrl")
        reject_unknown(entry, {"endpointUrl": None}, f"{what}.{key}")
        out.append((str(key), _http_url(f"{what}.{key}.endpointUrl", entry.get("endpointUrl"),
                                        "use the environment's credentials (AWS_* or the pod's service account)")))
    return tuple(out)


def _proxies(value: Any, what: str) -> tuple[tuple[str, str], ...]:
    """`{s3: http://127.0.0.1:65001, "s3://special-bucket": ...}`: a forward proxy per scheme or bucket."""
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: expected a mapping such as {{s3: http://127.0.0.1:65001}}")
    return tuple((str(key), _http_url(f"{what}.{key}", url, "run the proxy without authentication on the node "
                                                             "(dfdaemon listens on the node)"))
                 for key, url in value.items())


@dataclass(frozen=True)
class FetchSettings:
    """How a fetch reads its source (docs/fetch.md): what s3transfer's TransferConfig is to its TransferManager.
    The daemon, the direct CLI (`prefetch`, `verify --repair`) and the standalone CSI server read these the same
    way."""

    concurrency: int = setting(defaults.CONCURRENCY, "concurrency", whole_number, WHOLE,
                               env="WEIGHTCACHE_CONCURRENCY", flag=Flag("--concurrency", daemon=False))
    """Ranged GETs in flight per model fetch. Each worker holds 1 MiB for the piece of a large file it reads and
    1 MiB to hash from, and, when the model has files of at most `chunkSize`, a buffer the size of the largest:
    memory <= concurrency x (chunkSize + 1 MiB) per fetch (8 x 17 MiB), 16 MiB for a model of large files only."""
    chunk_size: int = setting(defaults.CHUNK_SIZE, "chunkSize", lambda v, w: max(1, parse_size(v, w)), SIZE,
                              env="WEIGHTCACHE_CHUNK_SIZE", flag=Flag("--chunk-size", daemon=False), shown="`16Mi`")
    """Files of at most this size (at least 64 KiB) are read whole in one request, without a resume journal;
    larger ones are written and journalled a 1 MiB piece at a time, so an interrupted download loses at most a
    piece per worker. Requests ask for whole chunks: about two per worker, but 4 (64 MiB by default) or more as
    long as every worker gets one, at most 256 MiB."""
    connect_timeout: float = setting(defaults.CONNECT_TIMEOUT, "connectTimeout", seconds, SECONDS,
                                     env="WEIGHTCACHE_CONNECT_TIMEOUT",
                                     flag=Flag("--connect-timeout", "SECONDS", daemon=False))
    """Seconds to open a connection to a model source (S3, http). A refused or timed-out connection is retried
    like throttling and 5xx: 5 attempts with backoff, then exit 6 / HTTP 502."""
    read_timeout: float = setting(defaults.READ_TIMEOUT, "readTimeout", seconds, SECONDS,
                                  env="WEIGHTCACHE_READ_TIMEOUT",
                                  flag=Flag("--read-timeout", "SECONDS", daemon=False))
    """Seconds a model source may stay silent on an open connection before the request is retried. With the
    defaults a blackholed endpoint fails in under 60 s."""
    endpoints: tuple[tuple[str, str], ...] = setting((), "endpoints", _endpoints, {
        "type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": False, "properties": {"endpointUrl": URL}}}, shown="none")
    """S3 endpoint overrides, for all of s3:// or by `s3://bucket` (the more specific wins):
    `{s3: {endpointUrl: "http://minio.storage:9000"}, "s3://special": {endpointUrl: "https://..."}}`; where none
    applies, the SDK's own (`AWS_ENDPOINT_URL`). Another scheme's key is refused (gs:// reads
    STORAGE_EMULATOR_HOST, az:// its connection string, hf:// HF_ENDPOINT). Credentials never go here: they come
    from the environment (AWS chain, workload identity)."""
    proxies: tuple[tuple[str, str], ...] = setting((), "proxies", _proxies,
                                                   {"type": "object", "additionalProperties": URL}, shown="none")
    """An HTTP(S) forward proxy per scheme or `scheme://bucket` (the more specific wins), for s3, http(s), hf and
    oci sources: `{s3: "http://127.0.0.1:65001"}` (else the SDK's `HTTPS_PROXY`, for the whole process). For
    clusters that keep a P2P engine for origin traffic, such as Dragonfly's dfdaemon in proxy mode
    (docs/peers.md). No credentials in the URL."""
    require_source_checksum: bool = setting(False, "requireSourceChecksum", boolean, BOOL,
                                            env="WEIGHTCACHE_REQUIRE_SOURCE_CHECKSUM")
    """Refuse (exit 8, nothing downloaded) a model with a file that nothing from its source verifies: no
    full-object checksum, MD5 or multipart ETag, source digest or `SHA256SUMS`/`*.sha256` sidecar (its record
    would be `none`; docs/fetch.md, "What verified a file"). `file://` and `memory://` models carry no such
    check."""
    endpoint_flag: str | None = None  # the command line's --endpoint-url: the command's reference's endpoint
    # the daemons that serve verified blobs (docs/peers.md): a running daemon's, not a setting read from a file
    peers: PeerSet | None = field(default=None, compare=False, repr=False)
    # a running daemon's bandwidth limits (bytesPerSecond, weightcache/ratelimit.py), handed to every Fetcher
    limits: BandwidthLimits | None = field(default=None, compare=False, repr=False)
    # source clients kept between fetches (sources/base.py ClientPool): the composing process's, never a file's
    clients: ClientPool | None = field(default=None, compare=False, repr=False)

    def endpoint_for(self, ref: ModelRef) -> str | None:
        """The endpoint for a reference: --endpoint-url, whatever the reference's scheme (it overrides the most
        specific entry the table has for it), else `scheme://bucket`, else `scheme`; None = the SDK's default.
        The flag with a reference of another scheme than s3 is refused (ConfigError, exit 2), never dropped."""
        if self.endpoint_flag is not None:
            _s3_only(ref.scheme, f"--endpoint-url with {ref.uri}")
            return self.endpoint_flag
        return _most_specific(self.endpoints, ref)

    def proxy_for(self, ref: ModelRef) -> str | None:
        """The forward proxy for a reference's source, chosen like its endpoint; None = no proxy of ours."""
        return _most_specific(self.proxies, ref)

    def with_peers(self, peers: PeerSet | None, *, limits: BandwidthLimits | None = None,
                   clients: ClientPool | None = None) -> FetchSettings:
        """These settings with the daemon's peer set, so its Fetchers ask peers first, its bandwidth limits and its
        kept source clients (`fetcher` hands them on)."""
        return replace(self, peers=peers, limits=limits, clients=clients)

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
                       limits=self.limits, clients=self.clients)


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
    fetch = parse_group(FetchSettings, raw)
    if endpoint_flag is None:
        return fetch
    return replace(fetch, endpoint_flag=_http_url("--endpoint-url", endpoint_flag, "use the environment's "
                                                  "credentials (AWS_* or the pod's service account)"))


def flags_from(args: object) -> dict[str, Any]:
    """The fetch flags a command line set (`fetch_flags`, and `--endpoint-url`), as config keys; unset ones (None)
    leave the file's and the environment's values."""
    flags = {key: getattr(args, attr, None) for attr, _, key in FETCH_FLAGS}
    url = getattr(args, "endpoint_url", None)
    if url:  # the endpoint of the command's reference, whatever its scheme; the file's other entries stay
        flags[ENDPOINT_FLAG] = url
    return flags


def fetch_flags(parser: argparse.ArgumentParser, *attrs: str, described: bool = True) -> None:
    """The direct CLI's fetch flags (`--concurrency`, `--read-timeout`, ...) of the FetchSettings fields `attrs`,
    declared from their keys as `weightcache daemon` declares its own; parsed, so a bad value is a usage error.
    Not `described`: without their help (docs_of reads this file's source: 14 ms of CPU of every prefetch, a hit
    through the daemon included), which describe_fetch_flags writes once help is shown."""
    docs = docs_of(FetchSettings) if described else {}
    for attr, key in keys_of(FetchSettings):
        if attr in attrs:
            add_flag(parser, key, dest=attr, doc=docs.get(attr, ""), default=getattr(FetchSettings, attr), check=True)


def describe_fetch_flags(parser: argparse.ArgumentParser, *attrs: str) -> None:
    """The help of the fetch flags fetch_flags declared without it."""
    docs, keys = docs_of(FetchSettings), dict(keys_of(FetchSettings))
    for action in parser._actions:
        if action.dest in attrs and action.dest in keys:
            action.help = flag_help(keys[action.dest], docs[action.dest], getattr(FetchSettings, action.dest))


def add_flag(parser: argparse.ArgumentParser, key: Key, *, dest: str, doc: str, default: Any,
             check: bool = False) -> None:
    """`key`'s flag: its help the first sentence of the field's docstring (`doc`), its environment variable and
    default. The value stays the text given (None when absent) for the key's parser to read with the file's and
    the environment's; `check`: read by that parser here already, so a bad value is argparse's usage error."""
    flag = key.flag
    assert flag is not None, key.name
    how: dict[str, Any] = {"action": "append"} if flag.repeat else \
        {"action": "store_const", "const": True} if flag.switch else {}
    if check:
        how["type"] = functools.partial(_checked, key)
    parser.add_argument(flag.name, dest=dest, metavar=flag.metavar or flag.name[2:].upper().replace("-", "_"),
                        help=flag_help(key, doc, default), **how)


def flag_help(key: Key, doc: str, default: Any) -> str:
    """A flag's help: the first sentence of its field's docstring (`doc`), its environment variable and default."""
    if key.shown and re.fullmatch(r"`[^`]+`", key.shown):
        default = key.shown.strip("`")  # 16Mi, not 16777216
    first = re.split(r"(?<=\.)\s+(?=[A-Z`])", doc, maxsplit=1)[0].rstrip(".")
    text = first + (f"; env {key.env}" if key.env else "") + (f" (default {default})" if default else "")
    return text.replace("%", "%%")


def _checked(key: Key, text: str) -> Any:
    try:
        return key.parse(text, "value")
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("value: ")) from None


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
            import difflib  # here: a mistyped field only, not every CLI start that declares fetch flags

            close = difflib.get_close_matches(str(key), list(known), n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"known fields: {', '.join(known)}"
            raise ConfigError(f"{where}: unknown field {key!r}; {hint}")


def _http_url(where: str, url: Any, credentials_hint: str) -> str:
    """An http(s) URL without userinfo (credentials never live in the config)."""
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        shown = redact(url) if isinstance(url, str) else url
        raise ConfigError(f"{where}: expected an http(s) URL, got {shown!r}")
    if "@" in url.partition("://")[2].partition("/")[0]:
        raise ConfigError(f"{where}: credentials do not belong in the URL; {credentials_hint}")
    return url




FETCH_ENV = {key.env: key.name for _, key in keys_of(FetchSettings) if key.env}  # variable -> config key
#: (attribute, flag, config key) of each fetch setting the direct CLI takes a flag for (`fetch_flags`)
FETCH_FLAGS = tuple((attr, key.flag.name, key.name) for attr, key in keys_of(FetchSettings) if key.flag)
