"""S3 (and S3-compatible stores: MinIO, Ceph RGW, R2) through boto3.

Each range read is one GET with `Range`, pinned with `If-Match: <etag>` (and `VersionId` when known), so bytes of
two object versions never mix. botocore's own retries are off: weightcache.retry retries throttling, 5xx,
refused, reset and timed-out connections, DNS failures and short bodies, asking only for the bytes still missing.
Integrity: a full-object checksum (SHA-256, CRC64NVME, CRC32C, CRC32) read by HEAD where the
listing shows one; else the ETag when it is an MD5 (single part, and no SSE-KMS/SSE-C seen in HEAD or GET).
S3 error codes become our exceptions by one table; messages carry the code and what to do, never credentials
(the cause is chained for detail).
"""

from __future__ import annotations

import base64
import builtins
import copy
import functools
import hashlib
import http.client
import logging
import os
import re
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

# botocore.httpsession imports urllib3.contrib.pyopenssl only to take the stdlib SSLContext it saved (botocore
# builds every context from the stdlib's), which is urllib3's own SSLContext unless pyOpenSSL was injected: where
# pyOpenSSL is installed, that import loaded pyOpenSSL and cryptography's x509 for nothing (0.1-0.3 s of a CLI
# fetch on the development VM). Refused during botocore's import, so it takes its stated fallback.
_PYOPENSSL = "urllib3.contrib.pyopenssl"
if _PYOPENSSL not in sys.modules:
    sys.modules[_PYOPENSSL] = None  # type: ignore[assignment]  # the import system's "not importable"
    try:
        import botocore.httpsession
    finally:
        del sys.modules[_PYOPENSSL]
import botocore.exceptions
import botocore.hooks
import botocore.loaders
import botocore.session
import msgspec
import urllib3.exceptions
from botocore.config import Config

from weightcache.checksums import FACTORIES
from weightcache.errors import (
    ObjectChangedError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
    WeightcacheError,
)
from weightcache.redact import redact
from weightcache.retry import body_timeout, first_byte_timeout
from weightcache.sources.base import (
    ClientPool,
    ObjectInfo,
    OnBytes,
    Pieces,
    Retryable,
    Source,
    SourceOptions,
    finish_listing,
    origin_pieces,
    read_body_into,
    read_range_into,
)
from weightcache.units import ascii_int
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)
T = TypeVar("T")
_Listing = tuple[list[ObjectInfo], set[str]]  # objects, and the keys whose listing shows a SHA-256 checksum

_DENIED = "give the node's credentials s3:ListBucket and s3:GetObject on {uri}, or check AWS_* settings"
_MISSING = "check that the bucket and prefix exist, e.g. `aws s3 ls {uri}`"
_CHANGED = "the object was replaced while downloading; fetch again to get the new version"
#: Anything else botocore raises on an answer (an HTML page, a redirect loop: its region redirector follows a 301
#: from a plain web server about 80 levels deep into a RecursionError, unparseable XML) means the endpoint is no S3.
_NOT_S3 = "the endpoint {where} did not answer like S3 ({kind}); check --endpoint-url / AWS_ENDPOINT_URL"
_MULTIPART = re.compile(r"([0-9a-f]{32})-([0-9]{1,5})")
MIB = 1 << 20
#: Part sizes uploaders use (rclone, aws-sdk-go: 5 MiB; aws cli / boto3: 8 MiB, doubled until 10,000 parts fit;
#: minio-go: multiples of 16 MiB; s3fs, s5cmd: 50 MiB), for a store whose HEAD ignores ?partNumber= (Ceph radosgw
#: 16): the part size is then one of these whose part count is the ETag's.
PART_SIZES = sorted({5 * MIB, 10 * MIB, 15 * MIB, 25 * MIB, 50 * MIB, 100 * MIB,
                     *(8 * MIB << k for k in range(12)), *(16 * MIB * k for k in range(1, 64))})

#: S3 error code (or bare HTTP status, as HEAD errors carry) -> our exception and a hint.
ERRORS: dict[str, tuple[type[SourceError], str]] = {
    "NoSuchBucket": (SourceNotFoundError, _MISSING),
    "NoSuchKey": (SourceNotFoundError, _MISSING),
    "NotFound": (SourceNotFoundError, _MISSING),
    "404": (SourceNotFoundError, _MISSING),
    "AccessDenied": (SourceAccessDeniedError, _DENIED),
    "AllAccessDisabled": (SourceAccessDeniedError, _DENIED),
    "AccountProblem": (SourceAccessDeniedError, _DENIED),
    "InvalidAccessKeyId": (SourceAccessDeniedError, _DENIED),
    "SignatureDoesNotMatch": (SourceAccessDeniedError, _DENIED),
    "ExpiredToken": (SourceAccessDeniedError, "the session token expired; refresh the node's credentials"),
    "InvalidToken": (SourceAccessDeniedError, _DENIED),
    "403": (SourceAccessDeniedError, _DENIED),
    "PreconditionFailed": (ObjectChangedError, _CHANGED),
    "412": (ObjectChangedError, _CHANGED),
}
#: Codes worth another attempt, besides any 5xx and 429.
RETRYABLE = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
    "RequestTimeout", "InternalError", "ServiceUnavailable",
})
#: Of those, the store asking the client to slow down: retried for THROTTLED_S, not DEFAULT_ATTEMPTS (retry.py).
THROTTLING = frozenset({"SlowDown", "Throttling", "ThrottlingException", "TooManyRequests", "RequestLimitExceeded",
                        "ServiceUnavailable", "503", "429"})
#: Transport failures worth another attempt (botocore wraps most; raw body reads raise the rest).
NETWORK_ERRORS = (
    botocore.exceptions.ConnectionError,  # refused, DNS failure (EndpointConnectionError), connect timeout
    botocore.exceptions.HTTPClientError,  # connection closed/reset, read timeouts, streaming errors
    botocore.exceptions.IncompleteReadError,
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    OSError,
)


class _Loader(botocore.loaders.Loader):  # type: ignore[misc]  # botocore ships no types
    """botocore's loader, but "which services exist" is one listdir of its data directories: the stock answer
    opens every version directory of all ~460 services it ships, once per model type (0.1-0.2 s of a CLI fetch),
    only for `load_service_model` to check that `s3` (or `sts` for the credential chain) is among them. A name
    listed here that lacks the model type still fails, in `determine_latest_version` (DataNotFoundError)."""

    def list_available_services(self, type_name: str) -> list[str]:
        return sorted({name for where in self._potential_locations(must_exist=True, is_dir=True)
                       for name in os.listdir(where)})


class _JsonFiles(botocore.loaders.JSONFileLoader):  # type: ignore[misc]  # botocore ships no types
    """botocore's data files decoded by msgspec into plain dicts: botocore's own decode builds an OrderedDict per
    JSON object through a Python hook, 0.11 of the 0.13 CPU s its three files cost a client (endpoints 1.3 MB, the
    S3 model 1.4 MB, its endpoint rules 0.9 MB: 57, 39 and 12 ms; here 23, 2 and 2 ms). Dicts keep their order,
    and nothing in botocore asks for the OrderedDict type."""

    def _load_file(self, full_path: str, open_method: Callable[..., Any]) -> Any:
        if not os.path.isfile(full_path):
            return None
        with open_method(full_path, "rb") as fp:
            return msgspec.json.decode(fp.read())


# botocore's service models and endpoint rules, parsed once per process: a fresh session parses their JSON again
# (0.27 CPU seconds a client; 0.03 with the loader shared). Each source still resolves credentials in a session
# of its own (a rotated key or token file is read again); a client is kept only for the same ones (_client).
_LOADER = _Loader(file_loader=_JsonFiles())


# held while `warm` parses: a fetch that starts meanwhile waits for that parse instead of doing it a second time
_warming = threading.Lock()
_handlers: list[botocore.hooks.HierarchicalEmitter] = []  # botocore's builtin event handlers, registered once


def _session() -> botocore.session.Session:
    """A botocore session of its own for one source (held `_warming`), its builtin event handlers copied from
    ones registered once per process, as each client copies its session's (the emitter's own __copy__): a new
    `Session()` registered all ~1,200 again, each signature checked by inspect, 9-15 ms of every fetch before
    its LIST (docs/fetch.md, "Small models")."""
    if not _handlers:
        _handlers.append(botocore.hooks.HierarchicalEmitter())
        botocore.session.Session(event_hooks=_handlers[0])  # registers the builtin handlers on it
    session = botocore.session.Session(event_hooks=copy.copy(_handlers[0]), include_builtin_handlers=False)
    session.register_component("data_loader", _LOADER)
    return session


def _client(endpoint_url: str | None, config: Config, settings: tuple[Any, ...],
            pool: ClientPool | None) -> tuple[tuple[Any, ...], float, Any]:
    """(key, created, client) for these settings: one `pool` kept under the same key, else a new one. Credentials
    are resolved anew each time, as a fresh client did (a rotated key or token file is read again): the key holds
    who they name, so rotated credentials get a new client, and a client whose credentials refresh themselves
    (STS, IMDS) keeps doing so. `settings`: everything of `config` that differs between sources."""
    with _warming:  # free at once unless `warm` is parsing what this client needs
        session = _session()
    key = (endpoint_url, *settings, *(session.get_config_variable(v) for v in ("region", "ca_bundle", "profile")),
           _identity(session.get_credentials()))
    kept = pool.take(key) if pool is not None else None
    if kept is not None:
        created, client = kept
        return key, created, client
    # create_client reuses the session's credentials resolved above
    return key, time.monotonic(), session.create_client("s3", endpoint_url=endpoint_url, config=config)


def warm() -> None:
    """Import botocore and parse its S3 model and endpoint data into the process's loader now: a daemon whose
    endpoints name S3 calls this in a thread at start, before its API answers (daemon/app.py), and its first
    fetch builds its client in a few ms instead of 0.3-0.5 CPU s. 16 daemons asked for a model at once spent 6 s
    of 2 shared cores on it before their first origin byte (docs/peers.md, "Less CPU a fill"). The client made
    here has made-up static credentials (no credential chain is asked, nothing is sent) and is closed at once."""
    with _warming:
        _session().create_client("s3", region_name="us-east-1", aws_access_key_id="warm",
                                 aws_secret_access_key="warm").close()


def _first_byte_deadline(read_timeout: float, params: dict[str, Any], context: dict[str, Any], **_: Any) -> None:
    """A ranged GET waits for its response as long as the range's size allows (retry.first_byte_timeout):
    botocore reads a read timeout from the request's context; `_open_range` sets the per-read one back for the
    body."""
    match = re.fullmatch(r"bytes=(\d{1,20})-(\d{1,20})", str(params.get("headers", {}).get("Range", "")))
    if match:
        length = int(match[2]) - int(match[1]) + 1
        context["read_timeout"] = first_byte_timeout(read_timeout, length)


def _identity(credentials: Any) -> tuple[str, ...]:
    """Who `credentials` name, the secret parts hashed (refreshable ones are refreshed first when due)."""
    if credentials is None:
        return ()
    frozen = credentials.get_frozen_credentials()
    secret = hashlib.sha256(f"{frozen.secret_key}\0{frozen.token or ''}".encode()).hexdigest()
    return credentials.method or "", frozen.access_key or "", secret


class S3Source(Source):
    """Lists and reads `s3://bucket/prefix/`. Thread-safe: one botocore client with a pool of `pool_size`."""

    name = "s3"
    page_size = 1000  # keys per ListObjectsV2 page (S3's maximum)

    def __init__(self, ref: ModelRef, options: SourceOptions | None = None) -> None:
        self.ref = ref
        self.options = o = options or SourceOptions()
        # botocore reads these itself; we look only to choose path-style addressing and to name it in errors
        self.endpoint_url = (o.endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3")
                             or os.environ.get("AWS_ENDPOINT_URL"))
        self._not_md5: set[str] = set()  # keys whose responses showed SSE-KMS/SSE-C: their ETag is no MD5
        self._guessed_parts: set[str] = set()  # keys whose part sizes the store did not say (PART_SIZES tried)
        config = Config(
            max_pool_connections=o.pool_size,
            retries={"total_max_attempts": 1, "mode": "standard"},  # weightcache.retry is the one loop that counts
            connect_timeout=o.connect_timeout,
            read_timeout=o.read_timeout,
            # a custom endpoint (MinIO, moto, 127.0.0.1) rarely has wildcard DNS for virtual-hosted buckets
            s3={"addressing_style": "path" if self.endpoint_url else "auto"},
            response_checksum_validation="when_required",
            proxies={"http": o.proxy_url, "https": o.proxy_url} if o.proxy_url else None,
        )
        self._key, self._created, self._client = _client(
            self.endpoint_url, config, (o.pool_size, o.connect_timeout, o.read_timeout, o.proxy_url), o.clients)
        self._client.meta.events.register("before-call.s3.GetObject", functools.partial(
            _first_byte_deadline, o.read_timeout), unique_id="weightcache-first-byte")

    def __repr__(self) -> str:
        return f"S3Source({self.ref.uri!r}, endpoint={self._endpoint()!r})"

    def _endpoint(self) -> str | None:
        return redact(self.endpoint_url) if self.endpoint_url else None  # an endpoint may carry user:password@

    def list(self) -> list[ObjectInfo]:
        listed, with_checksum = self._call(self._list_once, f"listing {self.ref.uri}")
        kept = finish_listing(self.ref, listed, hint=_MISSING.format(uri=self.ref.uri))
        if not with_checksum:
            return kept
        with ThreadPoolExecutor(min(16, len(with_checksum)), thread_name_prefix="s3-head") as pool:
            return list(pool.map(lambda o: self._with_checksum(o) if o.key in with_checksum else o, kept))

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        read_range_into(self.options, self._uri(obj.key), obj, offset, buf,
                        lambda pos, view: self._read_range(obj, pos, view))

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return origin_pieces(self.options, self._uri(obj.key), lambda pos, end: self._open_range(obj, pos, end),
                             offset, length, buf, on_bytes)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        """The object's MD5 when its ETag is one: a single-part upload without SSE-KMS/SSE-C, as far as the
        HEAD and GET responses seen so far show (call it after reading the object)."""
        etag = obj.etag or ""
        return etag if re.fullmatch(r"[0-9a-f]{32}", etag) and obj.key not in self._not_md5 else None

    def multipart_check(self, obj: ObjectInfo) -> builtins.list[int] | None:
        """The part sizes to check a multipart ETag (MD5 of the part MD5s, "-N") over: the one HEAD ?partNumber=1
        gives (the last part's checked to make them uniform, as peers/identity.py does), or, where the store
        ignores ?partNumber= (no PartsCount), every size of PART_SIZES giving N parts (any one matching passes).
        None: not a multipart ETag, SSE-KMS/SSE-C, or parts of unequal sizes."""
        m = _MULTIPART.fullmatch(obj.etag or "")
        if m is None or obj.key in self._not_md5:
            return None
        first = self._call(lambda: self.head(obj, IfMatch=f'"{obj.etag}"', PartNumber=1),
                           f"reading the part size of {self._uri(obj.key)}")
        self._note_encryption(obj.key, first)
        if obj.key in self._not_md5:
            return None
        count, parts = int(m[2]), int(first.get("PartsCount") or 0)
        if not parts:  # ?partNumber= ignored: the whole object answered
            self._guessed_parts.add(obj.key)
            return [p for p in PART_SIZES if -(-obj.size // p) == count] or None
        part = int(first.get("ContentLength") or 0)
        if parts != count or part <= 0 or -(-obj.size // part) != count:
            return None
        if count > 1:
            last = self._call(lambda: self.head(obj, IfMatch=f'"{obj.etag}"', PartNumber=count),
                              f"reading the part size of {self._uri(obj.key)}")
            if int(last.get("ContentLength") or -1) != obj.size - (count - 1) * part:
                return None  # parts of unequal sizes: their boundaries are not known
        return [part]

    def part_sizes_guessed(self, obj: ObjectInfo) -> bool:
        return obj.key in self._guessed_parts

    def head(self, obj: ObjectInfo, **params: Any) -> dict[str, Any]:
        """HeadObject of `obj`'s listed version, with `params` (IfMatch, PartNumber): one request, no retry (the
        caller goes without what it would show; peers/identity.py)."""
        args: dict[str, Any] = {"Bucket": self.ref.bucket, "Key": obj.key}
        if obj.version_id:
            args["VersionId"] = obj.version_id
        return self._client.head_object(**args, **params)  # type: ignore[no-any-return]

    def close(self) -> None:
        """Give the client back to the options' pool for the next source (its connections stay open while kept);
        without a pool, close it."""
        if self.options.clients is None:
            self._client.close()
        else:
            self.options.clients.give_back(self._key, self._created, self._client)

    def _uri(self, key: str) -> str:
        return f"s3://{self.ref.bucket}/{key}"

    def _list_once(self) -> _Listing:
        out: list[ObjectInfo] = []
        with_checksum: set[str] = set()
        pages = self._client.get_paginator("list_objects_v2").paginate(
            Bucket=self.ref.bucket, Prefix=self.ref.prefix, PaginationConfig={"PageSize": self.page_size})
        for page in pages:
            if "Name" not in page:  # every ListBucketResult names its bucket; a web server's 200 page does not
                raise SourceError(f"listing {self.ref.uri}: " + _NOT_S3.format(
                    where=self._endpoint() or "AWS S3", kind="no ListBucketResult in the answer"))
            for item in page.get("Contents", ()):
                key = item["Key"]
                if key.endswith("/"):  # a "directory marker" that consoles create
                    continue
                out.append(ObjectInfo(key, key[len(self.ref.prefix):], item["Size"], _unquote(item.get("ETag")),
                                      None, None))
                if any(a.lower() in FACTORIES for a in item.get("ChecksumAlgorithm", ())):
                    with_checksum.add(key)
        return out, with_checksum

    def _with_checksum(self, obj: ObjectInfo) -> ObjectInfo:
        """Ask HEAD for a full-object checksum this node can compute; a composite one (multipart: a checksum of
        part checksums) is no checksum of the bytes and is left out. HEAD also shows SSE, and the version."""
        head = self._call(lambda: self._client.head_object(Bucket=self.ref.bucket, Key=obj.key, ChecksumMode="ENABLED"),
                          f"reading the checksum of {self._uri(obj.key)}")
        self._note_encryption(obj.key, head)
        kind, etag = head.get("ChecksumType"), head.get("ETag") or ""
        for algorithm in FACTORIES:
            value = head.get(f"Checksum{algorithm.upper()}") or ""
            # some stores omit the "-N" suffix and the type of a multipart upload's composite checksum
            if not value or "-" in value or kind == "COMPOSITE" or ("-" in etag and kind != "FULL_OBJECT"):
                continue
            return ObjectInfo(obj.key, obj.relpath, head["ContentLength"], _unquote(head.get("ETag")),
                              head.get("VersionId"), (algorithm, base64.b64decode(value).hex()))
        return obj

    def _note_encryption(self, key: str, response: dict[str, Any]) -> None:
        if str(response.get("ServerSideEncryption", "")).startswith("aws:kms") or response.get("SSECustomerAlgorithm"):
            self._not_md5.add(key)

    def _read_range(self, obj: ObjectInfo, pos: int, view: memoryview) -> int:
        return read_body_into(self._open_range(obj, pos, pos + len(view)), view)  # our readinto: no copy

    def _open_range(self, obj: ObjectInfo, pos: int, end: int) -> Any:
        """GET bytes [pos, end) of the listed version: the raw urllib3 response, checked, body unread."""
        args: dict[str, Any] = {"Bucket": self.ref.bucket, "Key": obj.key, "Range": f"bytes={pos}-{end - 1}"}
        if obj.etag:
            args["IfMatch"] = f'"{obj.etag}"'
        if obj.version_id:
            args["VersionId"] = obj.version_id
        what = self._uri(obj.key)
        try:
            resp = self._client.get_object(**args)
        except (botocore.exceptions.ClientError, botocore.exceptions.NoCredentialsError) as exc:
            raise translate(exc, what, uri=self.ref.uri) from exc
        except NETWORK_ERRORS as exc:
            raise Retryable(self._network_reason(exc, "GET")) from exc
        except Exception as exc:
            raise self._not_s3(exc, f"reading {what}") from exc
        self._note_encryption(obj.key, resp)
        raw = resp["Body"]._raw_stream
        body_timeout(raw, self.options.read_timeout)  # the first byte may be slow in coming; every read after it not
        if obj.etag and _unquote(resp.get("ETag")) != obj.etag:  # a store that ignores If-Match
            raw.close()
            raise ObjectChangedError(f"{what} changed: ETag {resp.get('ETag')} is not {obj.etag}; {_CHANGED}")
        if not resp.get("ContentRange", "").startswith(f"bytes {pos}-") and pos:
            raw.close()
            raise SourceError(f"{what}: the store ignored the Range header; use an S3 endpoint that supports it")
        raw.enforce_content_length = False  # a short body returns what came; we count and resume from there
        return raw

    def _network_reason(self, exc: BaseException, request: str) -> str:
        """What failed, naming the endpoint without userinfo (botocore's own messages print it whole)."""
        where = self._endpoint() or "AWS S3"
        kind = "timed out" if isinstance(exc, (botocore.exceptions.ConnectTimeoutError,
                                               botocore.exceptions.ReadTimeoutError, TimeoutError)) else "failed"
        return f"{request} to {where} {kind} ({type(exc).__name__})"

    def _call(self, fn: Callable[[], T], what: str) -> T:
        """A request with the same classification and bounded retries as range reads."""
        def attempt() -> T:
            try:
                return fn()
            except (botocore.exceptions.ClientError, botocore.exceptions.NoCredentialsError) as exc:
                if _web_page(exc):
                    raise SourceError(f"{what}: " + _NOT_S3.format(
                        where=self._endpoint() or "AWS S3", kind=f"HTTP {_status(exc)} without an S3 error code")
                    ) from exc
                translated = translate(exc, what, uri=self.ref.uri)
                raise translated from exc
            except WeightcacheError:
                raise
            except NETWORK_ERRORS as exc:
                raise Retryable(self._network_reason(exc, what)) from exc
            except Exception as exc:
                raise self._not_s3(exc, what) from exc

        return self.options.retry(what).call(attempt)

    def _not_s3(self, exc: Exception, what: str) -> SourceError:
        """Whatever else escapes botocore: the endpoint answered, but not as S3 does (exit 6, no traceback)."""
        return SourceError(f"{what}: " + _NOT_S3.format(where=self._endpoint() or "AWS S3", kind=type(exc).__name__))


def translate(exc: botocore.exceptions.ClientError | botocore.exceptions.NoCredentialsError, what: str, *,
              uri: str) -> Exception:
    """The one S3 error table: a ClientError becomes `Retryable` or one of our SourceErrors (cause chained).
    `what` is the request that failed ("listing s3://..."), `uri` the model's prefix the hints name."""
    if isinstance(exc, botocore.exceptions.NoCredentialsError):
        denied = SourceAccessDeniedError(f"{what}: no AWS credentials found; set AWS_ACCESS_KEY_ID and "
                                         "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or give the node an IAM role")
        denied.__cause__ = exc
        return denied
    meta = exc.response.get("ResponseMetadata", {})
    status = int(meta.get("HTTPStatusCode") or 0)
    code = str(exc.response.get("Error", {}).get("Code") or status)
    if code in RETRYABLE or status == 429 or status >= 500:
        retry_after = meta.get("HTTPHeaders", {}).get("retry-after", "")
        return Retryable(f"{code} (HTTP {status})", ascii_int(retry_after),
                         throttled=code in THROTTLING or status in (429, 503))
    cls, hint = ERRORS.get(code) or ERRORS.get(str(status)) or (SourceError, "see the chained cause")
    err = cls(f"{what}: {code} (HTTP {status}); {hint.format(uri=uri)}")
    err.__cause__ = exc
    return err


def _status(exc: botocore.exceptions.ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)


def _web_page(exc: botocore.exceptions.ClientError | botocore.exceptions.NoCredentialsError) -> bool:
    """A listing refused with a 4xx whose body names no S3 error code (botocore leaves the code empty, or makes
    the status the code where the body is no XML at all):
    S3 and the stores like it answer ListObjectsV2 errors with an XML <Code> (NoSuchBucket, AccessDenied); a web
    server's 404 or 403 page (nginx, an ingress, a console port) has none. HEAD answers carry no body at all, so
    only the listing tells."""
    if not isinstance(exc, botocore.exceptions.ClientError) or exc.operation_name != "ListObjectsV2":
        return False
    status, code = _status(exc), str(exc.response.get("Error", {}).get("Code") or "")
    return 400 <= status < 500 and status != 429 and code in ("", str(status))


def _unquote(etag: str | None) -> str | None:
    return etag.strip('"') if etag else None
