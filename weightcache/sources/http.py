"""http(s):// models from a plain web server (nginx autoindex, a static mirror).

The listing comes from fsspec, which walks the server's HTML directory index, then one HEAD per file for its
size and ETag. Range reads go through a pooled urllib3 client straight into the caller's buffer (measured
faster than fsspec's aiohttp path: scripts/bench_sources.py). A strong ETag pins the version with `If-Match`;
412 means the file changed.
"""

from __future__ import annotations

import logging
from typing import Any
from urllib.parse import unquote

import urllib3

from weightcache.errors import ObjectChangedError, SourceAccessDeniedError, SourceError, SourceNotFoundError
from weightcache.sources.base import (
    ObjectInfo,
    OnBytes,
    Pieces,
    Retryable,
    SourceOptions,
    finish_listing,
    read_body_into,
    stream_range,
)
from weightcache.sources.fsspec import FsspecSource
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

_CHANGED = "the file changed on the server since it was listed; fetch again to get the new version"
#: HTTP status -> our exception and hint; 429 and 5xx are retried.
ERRORS: dict[int, tuple[type[SourceError], str]] = {
    401: (SourceAccessDeniedError, "the server wants credentials; serve the model without auth or use s3://"),
    403: (SourceAccessDeniedError, "the server refuses access; check its permissions"),
    404: (SourceNotFoundError, "check the URL and that the file is still published"),
    410: (SourceNotFoundError, "check the URL and that the file is still published"),
    412: (ObjectChangedError, _CHANGED),
}
NETWORK_ERRORS = (urllib3.exceptions.HTTPError, OSError)


class HttpSource(FsspecSource):
    """Listing by fsspec's HTTPFileSystem, ranged reads by urllib3 (Range, If-Match, readinto)."""

    def __init__(self, ref: ModelRef, options: SourceOptions | None = None) -> None:
        super().__init__(ref, options)
        o = self.options
        timeout = urllib3.Timeout(connect=o.connect_timeout, read=o.read_timeout)
        self._pool = (urllib3.ProxyManager(o.proxy_url, maxsize=o.pool_size, retries=False, timeout=timeout)
                      if o.proxy_url else urllib3.PoolManager(maxsize=o.pool_size, retries=False, timeout=timeout))

    def list(self) -> list[ObjectInfo]:
        def walk() -> list[ObjectInfo]:
            self._probe()
            self.fs.invalidate_cache(self.root)
            urls = [u for u in self.fs.find(self.root) if "?" not in u]  # skip index sort links (?C=N;O=D)
            return [self._object(u, self.fs.info(u)) for u in urls]

        objects = self._listing(walk)
        return finish_listing(self.ref, objects, hint="check the URL and that the server lists directories "
                                                      "(nginx: autoindex on)")

    def close(self) -> None:
        self._pool.clear()

    def _object(self, path: str, info: dict[str, Any]) -> ObjectInfo:
        etag = info.get("ETag")
        strong = etag.strip('"') if etag and not etag.startswith("W/") else None  # If-Match needs a strong one
        relpath = unquote(path[len(self.root):]) if path.startswith(self.root) else ""
        return ObjectInfo(path, relpath, int(info["size"]), strong, None, None)

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return stream_range(lambda pos, end: self._open_range(obj, pos, end), offset, length, buf,
                            self.options.retry(f"reading {obj.key} bytes {offset}-{offset + length - 1}"), on_bytes)

    def _read_range(self, obj: ObjectInfo, pos: int, view: memoryview) -> int:
        return read_body_into(self._open_range(obj, pos, pos + len(view)), view)

    def _open_range(self, obj: ObjectInfo, pos: int, end: int) -> Any:
        """GET bytes [pos, end) pinned with If-Match: the checked response, body unread."""
        headers = {"Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
        if obj.etag:
            headers["If-Match"] = f'"{obj.etag}"'
        try:
            resp = self._pool.request("GET", obj.key, headers=headers, preload_content=False, redirect=True)
        except NETWORK_ERRORS as exc:
            raise Retryable(f"{type(exc).__name__} on GET") from exc
        self._check(resp, obj, pos)
        if isinstance(resp, urllib3.HTTPResponse):
            resp.enforce_content_length = False  # a short body returns what came; we count and resume from there
        return resp

    def _probe(self) -> None:
        """GET the directory index first: fsspec's listing reports a refused or failing server as an empty
        directory, and an outage must be retried (and then named), not read as "no files here"."""
        try:
            resp = self._pool.request("GET", self.root, preload_content=False, redirect=True)
        except NETWORK_ERRORS as exc:
            raise Retryable(f"GET {self.root} failed ({type(exc).__name__})") from exc
        resp.drain_conn()
        resp.release_conn()
        if resp.status == 429 or resp.status >= 500:
            after = resp.headers.get("Retry-After", "")
            raise Retryable(f"HTTP {resp.status} listing {self.root}", float(after) if after.isdigit() else None)

    def _check(self, resp: Any, obj: ObjectInfo, pos: int) -> None:
        status = resp.status
        if status != 206 and status != 200:
            resp.close()
        if status == 429 or status >= 500:
            after = resp.headers.get("Retry-After", "")
            raise Retryable(f"HTTP {status}", float(after) if after.isdigit() else None)
        if status in ERRORS:
            cls, hint = ERRORS[status]
            raise cls(f"{obj.key}: HTTP {status}; {hint}")
        if status == 200 and pos == 0:
            return  # the whole file from byte 0: the first len(view) bytes are the ones wanted
        if status != 206 or not resp.headers.get("Content-Range", "").startswith(f"bytes {pos}-"):
            resp.close()
            raise SourceError(f"{obj.key}: HTTP {status} to a range request; serve it from a server that "
                              "supports Range (nginx, any static file server)")
