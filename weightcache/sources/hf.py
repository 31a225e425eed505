"""hf://org/name[@revision] models from the Hugging Face hub (or any server speaking its API: HF_ENDPOINT).

The listing is huggingface_hub's `model_info(files_metadata=True)` for the revision (default `main`), which
resolves it to a commit: every range read then asks for that commit's file (`/{repo}/resolve/{commit}/{file}`),
so a branch moving during the fetch can never mix two versions. LFS files carry their sha256, which the fetch
engine checks against the bytes it wrote. Range reads go through a pooled urllib3 client straight into the
caller's buffer; redirects (hub -> CDN) are followed here so that the token is sent to the hub's host only.

Token: HF_TOKEN, else the file named by HF_TOKEN_PATH (mount a Secret there), else huggingface_hub's stored
login. It is sent as `Authorization: Bearer` to the endpoint's host and appears in no message or log.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, urljoin, urlsplit

import urllib3

from weightcache.errors import (
    InvalidReferenceError,
    ObjectChangedError,
    SourceAccessDeniedError,
    SourceError,
    SourceNotFoundError,
)
from weightcache.sources.base import (
    ObjectInfo,
    OnBytes,
    Pieces,
    Retryable,
    SourceOptions,
    finish_listing,
    read_body_into,
    read_range_into,
    stream_range,
)
from weightcache.units import ascii_int
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

DEFAULT_ENDPOINT = "https://huggingface.co"
MAX_REDIRECTS = 5
_GATED = "accept the model's license on its hub page with the account whose token the node uses (HF_TOKEN or a " \
         "token file at HF_TOKEN_PATH)"


def endpoint() -> str:
    return (os.environ.get("HF_ENDPOINT") or DEFAULT_ENDPOINT).rstrip("/")


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


class HfSource:
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
        self.repo_id = "/".join(parts)
        from weightcache.hf_layout import validate_repo_id

        validate_repo_id(self.repo_id)
        self.endpoint = endpoint()
        self._host = urlsplit(self.endpoint).netloc
        self._token = token()
        o = self.options
        self._pool = urllib3.PoolManager(maxsize=o.pool_size, retries=False,
                                         timeout=urllib3.Timeout(connect=o.connect_timeout, read=o.read_timeout))
        self.commit: str | None = None

    def list(self) -> list[ObjectInfo]:
        from huggingface_hub import HfApi
        from huggingface_hub.errors import (
            GatedRepoError,
            HfHubHTTPError,
            RepositoryNotFoundError,
            RevisionNotFoundError,
        )

        revision = self.ref.revision or "main"
        api = HfApi(endpoint=self.endpoint, token=self._token or False)
        retry = self.options.retry(f"listing {self.ref.uri}@{revision}")
        while True:
            try:
                info = api.model_info(self.repo_id, revision=revision, files_metadata=True,
                                      timeout=self.options.read_timeout)
                break
            except GatedRepoError:
                raise SourceAccessDeniedError(f"{self.repo_id} is gated; {_GATED}") from None
            except RevisionNotFoundError:
                raise SourceNotFoundError(f"{self.repo_id} has no revision {revision!r}; check the branch, tag or "
                                          f"commit after '@'") from None
            except RepositoryNotFoundError:
                raise SourceNotFoundError(
                    f"{self.repo_id} not found at {self.endpoint} (or it is private and "
                    f"{'the token is refused' if self._token else 'no token is set: HF_TOKEN or HF_TOKEN_PATH'})"
                ) from None
            except HfHubHTTPError as exc:
                status = exc.response.status_code if exc.response is not None else 0
                if status in (401, 403):
                    raise SourceAccessDeniedError(f"{self.endpoint} refused {self.repo_id} (HTTP {status}); "
                                                  f"check the token's access") from None
                if status != 429 and status < 500:
                    raise SourceError(f"{self.endpoint} answered HTTP {status} for {self.repo_id}") from None
                retry.failed(Retryable(f"HTTP {status} listing {self.repo_id}"))
            except OSError as exc:  # connection refused, reset, DNS, timeouts (httpx errors are not OSError)
                retry.failed(Retryable(f"{type(exc).__name__} listing {self.repo_id}"))
            except Exception as exc:  # httpx transport errors
                if not type(exc).__module__.startswith("httpx"):  # httpx or httpx2, by version
                    raise
                retry.failed(Retryable(f"{type(exc).__name__} listing {self.repo_id}"))
        self.commit = info.sha
        objects = [self._object(s) for s in info.siblings or []]
        return finish_listing(self.ref, objects, hint=f"the repo {self.repo_id} holds no files at {revision}")

    def _object(self, sibling: Any) -> ObjectInfo:
        lfs = sibling.lfs
        sha256 = lfs.sha256 if lfs is not None else None
        size = lfs.size if lfs is not None else sibling.size
        if size is None:
            raise SourceError(f"{self.endpoint} listed {sibling.rfilename!r} without a size; is it a hub API?")
        return ObjectInfo(key=sibling.rfilename, relpath=sibling.rfilename, size=int(size),
                          etag=sha256 or sibling.blob_id, version_id=self.commit,
                          checksum=("sha256", sha256.lower()) if sha256 else None)

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        read_range_into(self.options, obj.key, obj, offset, buf,
                        lambda pos, view: read_body_into(self._open_range(obj, pos, pos + len(view)), view))

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return stream_range(lambda pos, end: self._open_range(obj, pos, end), offset, length, buf,
                            self.options.retry(f"reading {obj.key} bytes {offset}-{offset + length - 1}"), on_bytes)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return None  # hub ETags are git blob ids or sha256, never MD5

    def close(self) -> None:
        self._pool.clear()

    def _url(self, obj: ObjectInfo) -> str:
        return f"{self.endpoint}/{self.repo_id}/resolve/{obj.version_id}/{quote(obj.key)}"

    def _open_range(self, obj: ObjectInfo, pos: int, end: int) -> Any:
        """GET bytes [pos, end) of the listed commit's file: the checked response, body unread."""
        url = self._url(obj)
        headers = {"Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
        for _ in range(MAX_REDIRECTS + 1):
            auth = {"Authorization": f"Bearer {self._token}"} if self._token and \
                urlsplit(url).netloc == self._host else {}
            try:
                resp = self._pool.request("GET", url, headers={**headers, **auth}, preload_content=False,
                                          redirect=False)
            except (urllib3.exceptions.HTTPError, OSError) as exc:
                raise Retryable(f"{type(exc).__name__} on GET {obj.key}") from exc
            if resp.status in (301, 302, 303, 307, 308) and resp.headers.get("Location"):
                self._pinned(resp, obj)
                resp.drain_conn()
                url = urljoin(url, resp.headers["Location"])
                continue
            self._check(resp, obj, pos)
            return resp
        raise SourceError(f"{obj.key}: more than {MAX_REDIRECTS} redirects from {self.endpoint}")

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
