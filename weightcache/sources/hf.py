"""hf://org/name[@revision] models from the Hugging Face hub (or any server speaking its API: HF_ENDPOINT).

The listing is the hub's model API for the revision (default `main`) with file metadata
(`/api/models/{repo}/revision/{rev}?blobs=true`, what huggingface_hub's `model_info(files_metadata=True)` asks),
which resolves it to a commit: every range read then asks for that commit's file (`/{repo}/resolve/{commit}/{file}`),
so a branch moving during the fetch can never mix two versions. The listing is read here through the same pooled
urllib3 client as the bytes: its body is bounded, every field is checked (a missing or negative size, a commit
that is not 40 hex digits, a digest that is not 64 are each a SourceError naming the field), and it follows the
same redirect rule as the bytes.

Evidence: an LFS file's `lfs.sha256` is the hub's CLAIM. It checks the bytes this node downloads
(`claimed_sha256`, read by the fetch engine like a SHA256SUMS line) and is never a reason to link a blob already on
the node nor a digest to ask peers for: a lying hub or mirror could name another model's blob (docs/peers.md,
"What counts as evidence").

Redirects (the hub sends LFS files to its CDN): at most MAX_REDIRECTS, never from https to http, and only to the
hub's own host or to a host the operator allows: WEIGHTCACHE_HF_REDIRECT_HOSTS, comma-separated host names, each
matching itself and its subdomains (default for huggingface.co: huggingface.co and hf.co, its CDNs' domains).

Token: HF_TOKEN, else the file named by HF_TOKEN_PATH (mount a Secret there), else huggingface_hub's stored
login. It is sent as `Authorization: Bearer` to the endpoint's own scheme and host only (never to a CDN a redirect
names) and appears in no message or log.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import urllib3

from weightcache.errors import (
    InvalidReferenceError,
    InvalidRequestError,
    ObjectChangedError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
)
from weightcache.jsonbody import parse_json
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
from weightcache.units import ascii_int
from weightcache.uri import ModelRef, validate_repo_id

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_REDIRECT_HOSTS = ("huggingface.co", "hf.co")  # the public hub's CDNs: cdn-lfs*.hf.co, cas-bridge.xethub.hf.co
REDIRECT_HOSTS_ENV = "WEIGHTCACHE_HF_REDIRECT_HOSTS"
MAX_REDIRECTS = 5
MAX_LISTING_BYTES = 64 << 20  # a repo of 100,000 files lists in ~20 MB
MAX_FILE_SIZE = 1 << 42  # 4 TiB: the hub takes files of at most 50 GB; beyond this a size is a lie, not a model
_COMMIT = re.compile(r"[0-9a-f]{40}")
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")
_GATED = "accept the model's license on its hub page with the account whose token the node uses (HF_TOKEN or a " \
         "token file at HF_TOKEN_PATH)"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


def redirect_hosts(hub: str) -> tuple[str, ...]:
    """Host names a redirect may lead to besides the hub's own (each with its subdomains)."""
    configured = os.environ.get(REDIRECT_HOSTS_ENV)
    if configured is not None:
        return tuple(h.strip().lower().strip(".") for h in configured.split(",") if h.strip())
    return DEFAULT_REDIRECT_HOSTS if hub == DEFAULT_ENDPOINT else ()


def token() -> str | None:
    """HF_TOKEN, else the file at HF_TOKEN_PATH, else the login huggingface_hub stored."""
    if os.environ.get("HF_TOKEN"):
        return os.environ["HF_TOKEN"].strip()
    path = os.environ.get("HF_TOKEN_PATH")
    if path:
        try:
            return Path(path).read_text().strip() or None
        except OSError as exc:
            raise SourceAccessDeniedError(f"cannot read the Hugging Face token file HF_TOKEN_PATH={path}: "
                                          f"{exc.strerror}; check the Secret's mount") from None
    from huggingface_hub import get_token

    return get_token()


class HfSource(Source):
    """The hub's model API for the listing, pinned ranged GETs of `resolve/{commit}` for the bytes."""

    name = "hf"
    resolves_revision = True  # @revision is the hub's branch, tag or commit; the listing is that commit's files

    def __init__(self, ref: ModelRef, options: SourceOptions | None = None) -> None:
        self.ref = ref
        self.options = options or SourceOptions()
        parts = [ref.bucket, *[p for p in ref.prefix.split("/") if p]]
        if len(parts) > 2:
            raise InvalidReferenceError(f"{ref.uri}: a hub reference is hf://org/name[@revision]; subfolders of a "
                                        f"repo are chosen with include globs")
        self.repo_id = validate_repo_id("/".join(parts))
        self.endpoint = endpoint()
        hub = urlsplit(self.endpoint)
        self._origin = (hub.scheme, hub.netloc.lower())  # the token goes here and nowhere else
        self._redirect_hosts = redirect_hosts(self.endpoint)
        self._token = token()
        self._pool = self.options.http_pool()
        self.commit: str | None = None
        self._claims: dict[str, str] = {}

    def list(self) -> list[ObjectInfo]:
        revision = self.ref.revision or "main"
        url = f"{self.endpoint}/api/models/{self.repo_id}/revision/{quote(revision, safe='')}?blobs=true"
        retry = self.options.retry(f"listing {self.ref.uri}@{revision}")
        while True:
            try:
                info = self._listing(url, revision)
                break
            except Retryable as exc:
                retry.failed(exc)
        commit = info.get("sha")
        if not isinstance(commit, str) or not _COMMIT.fullmatch(commit):
            raise self._malformed("sha", commit, "the commit, 40 lowercase hex digits")
        siblings = info.get("siblings")
        if not isinstance(siblings, list):
            raise self._malformed("siblings", siblings, "a list of the repo's files")
        self.commit = commit
        objects = [self._object(i, s) for i, s in enumerate(siblings)]
        self._claims = {o.key: c for o, c in objects if c}
        return finish_listing(self.ref, [o for o, _ in objects],
                              hint=f"the repo {self.repo_id} holds no files at {revision}")

    def claimed_sha256(self, obj: ObjectInfo) -> str | None:
        """The sha256 the hub's listing names for an LFS file: a claim that checks downloaded bytes, never
        evidence to link a blob or ask peers for it."""
        return self._claims.get(obj.key)

    def _listing(self, url: str, revision: str) -> dict[str, Any]:
        resp = self._request(url, {"Accept": "application/json"}, f"listing {self.repo_id}")
        status, code = resp.status, resp.headers.get("X-Error-Code", "")
        if status != 200:
            message = resp.headers.get("X-Error-Message", "")
            resp.close()  # an error's body is never read: its size is the hub's choice
            if status == 429 or status >= 500:
                raise Retryable(f"HTTP {status} listing {self.repo_id}", ascii_int(resp.headers.get("Retry-After", "")))
            if code == "GatedRepo":
                raise SourceAccessDeniedError(f"{self.repo_id} is gated; {_GATED}")
            if code == "RevisionNotFound":
                raise SourceNotFoundError(f"{self.repo_id} has no revision {revision!r}; check the branch, tag or "
                                          f"commit after '@'")
            if code == "RepoNotFound" or (status == 401 and "Invalid credentials" not in message) or status == 404:
                raise SourceNotFoundError(
                    f"{self.repo_id} not found at {self.endpoint} (or it is private and "
                    f"{'the token is refused' if self._token else 'no token is set: HF_TOKEN or HF_TOKEN_PATH'})")
            if status in (401, 403):
                raise SourceAccessDeniedError(f"{self.endpoint} refused {self.repo_id} (HTTP {status}); "
                                              f"check the token's access")
            raise SourceError(f"{self.endpoint} answered HTTP {status} for {self.repo_id}; is HF_ENDPOINT a hub?")
        try:
            body = _read_bounded(resp, MAX_LISTING_BYTES)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise Retryable(f"{type(exc).__name__} reading the listing of {self.repo_id}") from exc
        if body is None:
            raise SourceError(f"{self.endpoint}'s listing of {self.repo_id} is over {MAX_LISTING_BYTES >> 20} MiB; "
                              f"is HF_ENDPOINT a hub? Fetch a mirror of the repo instead")
        try:
            info = parse_json(body, what=f"{self.endpoint}'s listing of {self.repo_id}", example='{"sha": ...}')
        except InvalidRequestError as exc:
            raise SourceError(f"{exc}; is HF_ENDPOINT a Hugging Face hub?") from None
        if not isinstance(info, dict):
            raise self._malformed("(body)", info, "a JSON object")
        return info

    def _object(self, index: int, sibling: object) -> tuple[ObjectInfo, str | None]:
        """One listed file, every field checked: the listing is the hub's word, nothing more."""
        where = f"siblings[{index}]"
        if not isinstance(sibling, dict):
            raise self._malformed(where, sibling, "an object with rfilename and size")
        name = sibling.get("rfilename")
        if not isinstance(name, str) or not name:
            raise self._malformed(f"{where}.rfilename", name, "the file's path in the repo")
        where = f"{where} ({name[:200]!r})"
        lfs = sibling.get("lfs")
        if lfs is not None and not isinstance(lfs, dict):
            raise self._malformed(f"{where}.lfs", lfs, "an object with sha256 and size")
        size = self._size(f"{where}.size", sibling.get("size"), required=lfs is None)
        sha256 = None
        if lfs is not None:
            lfs_size = self._size(f"{where}.lfs.size", lfs.get("size"), required=size is None)
            if size is not None and lfs_size is not None and size != lfs_size:
                raise self._malformed(f"{where}.lfs.size", lfs_size, f"the file's size, {size} as size says")
            size = size if size is not None else lfs_size
            sha256 = lfs.get("sha256")
            if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
                raise self._malformed(f"{where}.lfs.sha256", sha256, "64 hex digits")
            sha256 = sha256.lower()
        blob_id = sibling.get("blobId")
        if blob_id is not None and (not isinstance(blob_id, str) or not blob_id.isascii() or len(blob_id) > 128):
            raise self._malformed(f"{where}.blobId", blob_id, "the git blob id")
        assert size is not None  # required above
        return ObjectInfo(key=name, relpath=name, size=size, etag=sha256 or blob_id, version_id=self.commit,
                          checksum=None), sha256

    def _size(self, field: str, value: object, *, required: bool) -> int | None:
        if value is None and not required:
            return None
        number = ascii_int(value) if isinstance(value, str) else value  # some mirrors quote numbers
        if isinstance(number, bool) or not isinstance(number, int) or not 0 <= number <= MAX_FILE_SIZE:
            raise self._malformed(field, value, f"a number of bytes from 0 to {MAX_FILE_SIZE}")
        return number

    def _malformed(self, field: str, value: object, want: str) -> SourceError:
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:80] + "..."
        return SourceError(f"{self.endpoint}'s listing of {self.repo_id} has {field} = {shown}, expected {want}; "
                           f"is HF_ENDPOINT a Hugging Face hub (or a faithful mirror)?")

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        read_range_into(self.options, obj.key, obj, offset, buf,
                        lambda pos, view: read_body_into(self._open_range(obj, pos, pos + len(view)), view))

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return origin_pieces(self.options, obj.key, lambda pos, end: self._open_range(obj, pos, end), offset, length,
                             buf, on_bytes)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return None  # hub ETags are git blob ids or sha256, never MD5

    def close(self) -> None:
        self._pool.clear()

    def _url(self, obj: ObjectInfo) -> str:
        return f"{self.endpoint}/{self.repo_id}/resolve/{obj.version_id}/{quote(obj.key)}"

    def _open_range(self, obj: ObjectInfo, pos: int, end: int) -> Any:
        """GET bytes [pos, end) of the listed commit's file: the checked response, body unread."""
        headers = {"Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
        resp = self._request(self._url(obj), headers, f"GET {obj.key}", lambda r: self._pinned(r, obj))
        self._check(resp, obj, pos)
        return resp

    def _request(self, url: str, headers: dict[str, str], what: str, on_redirect: Any = None) -> Any:
        """GET `url`, following the hub's redirects under this module's rule; the response, body unread. The
        token goes only to the hub's own scheme and host."""
        for _ in range(MAX_REDIRECTS + 1):
            target = urlsplit(url)
            auth = {"Authorization": f"Bearer {self._token}"} if self._token and \
                (target.scheme, target.netloc.lower()) == self._origin else {}
            try:
                resp = self._pool.request("GET", url, headers={**headers, **auth}, preload_content=False,
                                          redirect=False)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise Retryable(f"{type(exc).__name__} on {what}") from exc
            if resp.status not in (301, 302, 303, 307, 308) or not resp.headers.get("Location"):
                return resp
            if on_redirect is not None:
                on_redirect(resp)
            resp.drain_conn()
            url = urljoin(url, resp.headers["Location"])
            self._allowed(url, what)
        raise SourceError(f"{what}: more than {MAX_REDIRECTS} redirects from {self.endpoint}")

    def _allowed(self, url: str, what: str) -> None:
        """A redirect may lead to the hub itself or a host the operator allows, never down from https."""
        target = urlsplit(url)
        host = (target.hostname or "").lower()
        if (target.scheme, target.netloc.lower()) == self._origin:
            return
        if target.scheme not in ("http", "https") or (self._origin[0] == "https" and target.scheme != "https"):
            raise SourceError(f"{what}: {self.endpoint} redirected to a {target.scheme or 'relative'}:// URL; "
                              f"only https redirects are followed from an https hub")
        if not any(host == h or host.endswith("." + h) for h in self._redirect_hosts):
            raise SourceError(f"{what}: {self.endpoint} redirected to {host[:100]!r}, which is neither the hub nor "
                              f"an allowed host; list the hub's CDN hosts in {REDIRECT_HOSTS_ENV} (comma-separated)")

    def _pinned(self, resp: Any, obj: ObjectInfo) -> None:
        commit = resp.headers.get("X-Repo-Commit")
        if commit and obj.version_id and commit != obj.version_id:
            resp.close()
            raise ObjectChangedError(f"{self.repo_id}/{obj.key}: the hub served commit {commit[:12]}, not the listed "
                                     f"{obj.version_id[:12]}; fetch again")

    def _check(self, resp: Any, obj: ObjectInfo, pos: int) -> None:
        status = resp.status
        if status not in (200, 206):
            resp.close()
        if status == 429 or status >= 500:
            after = resp.headers.get("Retry-After", "")
            raise Retryable(f"HTTP {status}", ascii_int(after))
        if status in (401, 403):
            raise SourceAccessDeniedError(f"{self.repo_id}/{obj.key}: HTTP {status}; check the token's access "
                                          f"(a gated repo: {_GATED})")
        if status == 404:
            raise SourceNotFoundError(f"{self.repo_id}/{obj.key}: HTTP 404 at commit {obj.version_id}; fetch again")
        self._pinned(resp, obj)
        if status == 200 and pos == 0:
            return
        if status != 206 or not resp.headers.get("Content-Range", "").startswith(f"bytes {pos}-"):
            resp.close()
            raise SourceError(f"{self.repo_id}/{obj.key}: HTTP {status} to a range request from {self.endpoint}")


def _read_bounded(resp: Any, limit: int) -> bytes | None:
    """The body, or None once it passes `limit` bytes (the connection is then closed, not drained)."""
    chunks, total = [], 0
    while chunk := resp.read(1 << 20):
        total += len(chunk)
        if total > limit:
            resp.close()
            return None
        chunks.append(chunk)
    return b"".join(chunks)
