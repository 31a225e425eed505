"""Talking to one peer's blob server: does it hold a blob (HEAD), and a ranged body of it (GET).

A peer is untrusted like an origin: it may lie about holding a blob, send other bytes, stall or vanish. The
client only reports what the peer said; `weightcache/peers/source.py` decides what to believe (every byte is
hashed, every blob verified against the origin's evidence before publish).
"""

from __future__ import annotations

import logging
import re
from typing import Any
from urllib.parse import urlsplit

import urllib3

from weightcache.errors import Answer, ConfigError, SourceError
from weightcache.redact import redact
from weightcache.retry import Retryable

log = logging.getLogger(__name__)

NETWORK_ERRORS = (urllib3.exceptions.HTTPError, OSError)
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/\d+")
PARTIAL_HEADER = "X-Weightcache-Partial"  # set on answers about a blob still being downloaded


class PeerRangeMissing(SourceError):
    """The peer is still downloading the blob and lacks the bytes asked for (404 to a range of a blob it said
    it had): ask the next source, without counting it against the peer."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerBusy(PeerRangeMissing):
    """The peer serves this node as many streams as it allows (429): ask again shortly or elsewhere, no fault."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


class PeerUnreachable(SourceError):
    """The peer did not answer (refused, timed out, reset): not asked again during this fetch."""
    answer = Answer(6, 502, "UNAVAILABLE")  # handled inside a fetch; this is what shows if one ever escapes


def peer_base_url(url: str) -> str:
    """`http(s)://host:port` of a configured peer, without path, query or userinfo; ConfigError otherwise."""
    parts = urlsplit(url.strip())
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.username or parts.password:
        raise ConfigError(f"peer {redact(url)!r}: expected http(s)://HOST:PORT (no userinfo: the token comes "
                          "from peerTokenFile)")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"peer {url!r}: expected http(s)://HOST:PORT with no path")
    try:
        port = parts.port
    except ValueError as exc:
        raise ConfigError(f"peer {url!r}: {exc}") from exc
    host = f"[{parts.hostname}]" if ":" in parts.hostname else parts.hostname
    return f"{parts.scheme}://{host}" + (f":{port}" if port else "")


class PeerClient:
    """One peer's blob endpoint; thread-safe (urllib3 pool)."""

    def __init__(self, url: str, token: bytes, *, connect_timeout: float, read_timeout: float,
                 pool_size: int = 8, ca_certs: str | None = None) -> None:
        self.url = peer_base_url(url)
        self._auth = {"Authorization": "Bearer " + token.decode("ascii", "replace")}
        self._pool = urllib3.PoolManager(maxsize=pool_size, retries=False, ca_certs=ca_certs,
                                         timeout=urllib3.Timeout(connect=connect_timeout, read=read_timeout))

    def __repr__(self) -> str:
        return f"PeerClient({self.url})"

    def blob_url(self, sha256: str) -> str:
        return f"{self.url}/v1/blobs/sha256/{sha256}"

    def holds(self, sha256: str, size: int) -> bool:
        """The peer says it has the blob, with the size the origin lists (a different size: not the same blob,
        so no point asking). Refusals read as 'no'; PeerUnreachable when the peer cannot be reached."""
        return self.probe(sha256, size) is not None

    def probe(self, sha256: str, size: int) -> str | None:
        """"blob" (published there), "partial" (downloading it now) or None (neither, or another size)."""
        try:
            resp = self._pool.request("HEAD", self.blob_url(sha256), headers=self._auth, redirect=False)
        except NETWORK_ERRORS as exc:
            raise PeerUnreachable(f"peer {self.url} unreachable: {type(exc).__name__}") from exc
        if resp.status == 401:
            log.warning("peer %s refuses our token (401): the daemons' peerTokenFile must hold the same token",
                        self.url)
        if resp.status != 200 or resp.headers.get("Content-Length") != str(size):
            return None
        return "partial" if resp.headers.get(PARTIAL_HEADER) else "blob"

    def open_range(self, sha256: str, pos: int, end: int) -> Any:
        """GET bytes [pos, end) of a blob: the checked response, body unread; Retryable for anything else."""
        resp, served = self.open_span(sha256, pos, end)
        if served != end:
            resp.close()
            raise Retryable(f"peer {self.url} answered bytes {pos}-{served - 1} to bytes {pos}-{end - 1}")
        return resp

    def open_span(self, sha256: str, pos: int, end: int) -> tuple[Any, int]:
        """GET bytes [pos, end) of a blob; a peer still downloading it may answer a shorter span [pos, served):
        (the checked response with its body unread, served)."""
        headers = {**self._auth, "Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"}
        try:
            resp = self._pool.request("GET", self.blob_url(sha256), headers=headers, preload_content=False,
                                      redirect=False)
        except NETWORK_ERRORS as exc:
            raise Retryable(f"{type(exc).__name__} from peer {self.url}") from exc
        if resp.status == 404 and resp.headers.get(PARTIAL_HEADER):
            resp.close()
            raise PeerRangeMissing(f"peer {self.url} has not downloaded bytes {pos}-{end - 1} yet")
        if resp.status == 429:
            resp.close()
            raise PeerBusy(f"peer {self.url} is serving us all the streams it allows")
        m = _CONTENT_RANGE.fullmatch(resp.headers.get("Content-Range", "")) if resp.status == 206 else None
        if m is None or int(m[1]) != pos or not pos <= int(m[2]) < end:
            resp.close()
            raise Retryable(f"peer {self.url} answered HTTP {resp.status} to bytes {pos}-{end - 1}")
        if isinstance(resp, urllib3.HTTPResponse):
            resp.enforce_content_length = False  # a short body returns what came: the caller resumes elsewhere
        return resp, int(m[2]) + 1

    def close(self) -> None:
        self._pool.clear()
