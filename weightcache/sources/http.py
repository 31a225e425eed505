"""http(s):// models from a plain web server (nginx autoindex, a static mirror).

The listing walks the server's HTML directory indexes (links to files below the model's URL; parent, query
and foreign links skipped; files outside the globs neither read nor counted; at most MAX_DEPTH levels, MAX_FILES
files and directories, paths of MAX_PATH_BYTES), then one HEAD per file, 16 at a time, for its size and ETag.
Everything goes through one pooled urllib3 client; range reads land straight in the caller's buffer (measured
faster than fsspec's aiohttp path: scripts/bench_sources.py, and the listing no longer imports aiohttp: 0.15 s
of every CLI prefetch). A strong ETag pins the version with `If-Match`; 412 means the file changed.
"""

from __future__ import annotations

import builtins
import html
import logging
import re
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import unquote, urldefrag, urljoin

import urllib3

from weightcache.errors import (
    HostileKeyError,
    ObjectChangedError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
)
from weightcache.retry import body_timeout, first_byte_timeout
from weightcache.sources.base import (
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
from weightcache.store.paths import MAX_DEPTH, MAX_FILES, MAX_PATH_BYTES
from weightcache.units import ascii_int
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
NETWORK_ERRORS = (urllib3.exceptions.HTTPError, OSError)  # what urllib3 raises when a connection breaks


def read_capped(resp: Any, limit: int, what: str, broke: type[Exception] = Retryable) -> bytes:
    """At most `limit` + 1 bytes of `resp`'s body (decoded), its connection released; a connection that breaks
    while it is read raises `broke` naming `what` (Retryable by default: the caller's retry loop asks again). The
    caller refuses a body over `limit`, in its own words."""
    try:
        body: bytes = resp.read(limit + 1, decode_content=True)
    except NETWORK_ERRORS as exc:
        raise broke(f"{type(exc).__name__} reading {what}") from exc
    finally:
        resp.release_conn()
    return body
_STATIC = "serve it from a static file server"
_RANGES = "serve it from a server that supports Range (nginx, any static file server)"
#: one <a ...> start tag. Linear: `hrefs` cuts the page after its last '>', so every attempt ends at the next '>'
#: and the scan resumes behind it (a hostile `<a <a <a` index costs one pass, never a backtracking storm).
_A_TAG = re.compile(r"<a\s[^>]*>", re.IGNORECASE)
#: the href attribute inside one tag: quoted either way or bare (nginx, Apache and python -m http.server indexes)
_HREF = re.compile(r"""\shref\s*=\s*(?:"([^"]*)"|'([^']*)'|([^\s"'>]+))""", re.IGNORECASE)
_INDEX_MAX = 64 << 20  # bytes of one directory index read, at most
_HEADS = 16  # HEAD requests in flight while listing


def hrefs(page: str) -> Iterator[str]:
    """The href of every <a> tag of an HTML page, entities decoded, in time linear in the page (a regex or
    html.parser that backtracks would hold the GIL, and so the daemon's CSI Probe, for as long as a server likes)."""
    for tag in _A_TAG.finditer(page, 0, page.rfind(">") + 1):
        attr = _HREF.search(tag.group())
        if attr and attr.lastindex:
            yield html.unescape(attr.group(attr.lastindex))


#: Servers whose directory indexes leave dotfiles out by default (nginx's autoindex always; Apache's IndexIgnore
#: ".??*"): a listing from one says so, since what it does not show is not fetched.
HIDES_DOTFILES = ("nginx", "apache", "openresty")


class HttpSource(Source):
    """Listing by the server's HTML indexes, ranged reads by urllib3 (Range, If-Match, readinto)."""

    name = "http"

    def __init__(self, ref: ModelRef, options: SourceOptions | None = None) -> None:
        self.ref = ref
        self.name = ref.scheme
        self.options = o = options or SourceOptions()
        self.root = ref.uri.rstrip("/") + "/"
        self._pool = o.http_pool()
        self._index_servers: set[str] = set()  # the Server headers of the index pages read

    def __repr__(self) -> str:
        return f"HttpSource({self.ref.uri!r})"

    def list(self) -> list[ObjectInfo]:
        urls = self.options.retry(f"listing {self.ref.uri}").call(self._walk)
        with ThreadPoolExecutor(max(1, min(_HEADS, len(urls))), thread_name_prefix="http-head") as pool:
            objects = list(pool.map(self._object, urls))
        hiding = sorted(s for s in self._index_servers if s.lower().startswith(HIDES_DOTFILES) or not s)
        if hiding and not any(part.startswith(".") for o in objects for part in o.relpath.split("/")):
            log.warning("%s: listed from %s's directory index, which never lists dotfiles (nginx autoindex, "
                        "Apache's IndexIgnore): a file or directory named .* (.gitattributes, .cache/...) is not "
                        "fetched; serve it under another name, or the model from an object store",
                        self.ref.uri, hiding[0] or "a server without a Server header")
        return finish_listing(self.ref, objects, hint="check the URL and that the server lists directories "
                                                      "(nginx: autoindex on)")

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        read_range_into(self.options, obj.key, obj, offset, buf, lambda pos, view: self._read_range(obj, pos, view))

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return None  # S3's alone

    def close(self) -> None:
        self._pool.clear()

    def _walk(self) -> builtins.list[str]:
        """The URLs of the files below the root that pass the globs, from its index pages (one GET each, breadth
        first). Directories count toward MAX_FILES with the files and no path may be longer than MAX_PATH_BYTES,
        so a wide or deep tree of directories or links costs bounded GETs and memory."""
        files: set[str] = set()
        dirs, seen = deque([self.root]), {self.root}
        while dirs:
            url = dirs.popleft()
            if url[len(self.root):].count("/") >= MAX_DEPTH:
                raise HostileKeyError(unquote(url[len(self.root):]), f"more than {MAX_DEPTH} directories deep")
            for link in self._links(url):
                if link in seen or link in files:  # '#frag' forms and Apache's icon links repeat a link
                    continue
                relpath = unquote(link[len(self.root):])
                is_dir = link.endswith("/")
                if not is_dir and not self.ref.matches(relpath):
                    continue
                if len(relpath.encode()) > MAX_PATH_BYTES:
                    raise HostileKeyError(relpath[:200] + "...", f"path longer than {MAX_PATH_BYTES} bytes")
                if is_dir:
                    seen.add(link)
                    dirs.append(link)
                else:
                    files.add(link)
                if len(files) + len(seen) - 1 > MAX_FILES:
                    raise HostileKeyError(relpath, f"the model has more than {MAX_FILES} files and directories; "
                                                   "narrow it with --include/--exclude")
        return sorted(files)

    def _links(self, url: str) -> Iterator[str]:
        """Links of one index page to files and directories below the root (parents, queries such as the sort
        links ?C=N;O=D, and other hosts skipped), repeats included, one at a time so that the walk refuses a page
        of millions at MAX_FILES without holding them; none where there is no such directory (404, 410)."""
        try:
            resp = self._get(url, "listing")
        except SourceNotFoundError:
            return
        self._index_servers.add(str(resp.headers.get("Server", ""))[:80])
        text = read_capped(resp, _INDEX_MAX, f"the index {url}")
        if len(text) > _INDEX_MAX:
            raise SourceError(f"{url}: the directory index is over {_INDEX_MAX >> 20} MiB; serve a smaller tree")
        for href in hrefs(text.decode("utf-8", "replace")):
            link = urldefrag(urljoin(url, href)).url
            if "?" not in link and len(link) > len(url) and link.startswith(url):
                yield link

    def _get(self, url: str, what: str) -> Any:
        try:
            resp = self._pool.request("GET", url, preload_content=False, redirect=True)
        except NETWORK_ERRORS as exc:
            raise Retryable(f"GET {url} failed ({type(exc).__name__})") from exc
        raise_for_status(resp, f"{what} {url}", (200,), "serve the model's directory as an HTML index")
        return resp

    def _object(self, url: str) -> ObjectInfo:
        """HEAD for the size and the ETag (retried like every request)."""
        def head() -> Any:
            try:
                resp = self._pool.request("HEAD", url, redirect=True)
            except NETWORK_ERRORS as exc:
                raise Retryable(f"HEAD {url} failed ({type(exc).__name__})") from exc
            raise_for_status(resp, f"HEAD {url}", (200,), _STATIC)
            return resp

        resp = self.options.retry(f"HEAD {url}").call(head)
        length = resp.headers.get("Content-Length", "")
        size = ascii_int(length)
        if size is None:
            raise SourceError(f"{url}: the server gives no Content-Length; {_STATIC}" if not length else
                              f"{url}: the server's Content-Length {length[:40]!r} is not a byte count; {_STATIC}")
        etag = resp.headers.get("ETag")
        strong = etag.strip('"') if etag and not etag.startswith("W/") else None  # If-Match needs a strong one
        return ObjectInfo(url, unquote(url[len(self.root):]), size, strong, None, None)

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return origin_pieces(self.options, obj.key, lambda pos, end: self._open_range(obj, pos, end), offset, length,
                             buf, on_bytes)

    def _read_range(self, obj: ObjectInfo, pos: int, view: memoryview) -> int:
        return read_body_into(self._open_range(obj, pos, pos + len(view)), view)

    def _open_range(self, obj: ObjectInfo, pos: int, end: int) -> Any:
        """GET bytes [pos, end) pinned with If-Match: the checked response, body unread."""
        headers = {"Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
        if obj.etag:
            headers["If-Match"] = f'"{obj.etag}"'
        o = self.options
        timeout = urllib3.Timeout(connect=o.connect_timeout, read=first_byte_timeout(o.read_timeout, end - pos))
        try:
            resp = self._pool.request("GET", obj.key, headers=headers, preload_content=False, redirect=True,
                                      timeout=timeout)
        except NETWORK_ERRORS as exc:
            raise Retryable(f"{type(exc).__name__} on GET") from exc
        body_timeout(resp, o.read_timeout)  # the first byte may be slow in coming; every read after it may not
        self._check(resp, obj, pos)
        if isinstance(resp, urllib3.HTTPResponse):
            resp.enforce_content_length = False  # a short body returns what came; we count and resume from there
        return resp

    def _check(self, resp: Any, obj: ObjectInfo, pos: int) -> None:
        raise_for_status(resp, obj.key, (200, 206), _RANGES)
        if resp.status == 200 and pos == 0:
            return  # the whole file from byte 0: the first len(view) bytes are the ones wanted
        if resp.status != 206 or not resp.headers.get("Content-Range", "").startswith(f"bytes {pos}-"):
            resp.close()
            raise SourceError(f"{obj.key}: HTTP {resp.status} to a range request; {_RANGES}")


def raise_for_status(resp: Any, what: str, ok: tuple[int, ...], hint: str) -> None:
    """Return for a status in `ok`; else raise: 429 and 5xx Retryable (after the server's Retry-After), the
    refusals of ERRORS with their hints, anything else SourceError with `hint`. The module's one status table."""
    status = resp.status
    if status in ok:
        return
    resp.close()  # an error's body is never read: its size is the server's choice
    if status == 429 or status >= 500:
        raise Retryable(f"HTTP {status} on {what}", ascii_int(resp.headers.get("Retry-After", "")))
    cls, fix = ERRORS.get(status, (SourceError, hint))
    raise cls(f"{what}: HTTP {status}; {fix}")
