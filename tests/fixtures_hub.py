"""A local server on 127.0.0.1 that speaks the Hugging Face hub's API the way huggingface.co does, for hf:// tests.

    GET /api/models/{repo}/revision/{rev}     model info: sha (the commit), siblings with size, blobId and, for LFS
                                              files, lfs {sha256, size}; 401 + X-Error-Code RepoNotFound for a
                                              private repo without the token, 404 RevisionNotFound
    GET /{repo}/resolve/{rev}/{file}          regular files: the bytes (Range honoured), ETag = git blob id;
                                              LFS files: 302 to the CDN on ANOTHER host name (localhost), as the hub
                                              redirects to its CDN; both with X-Repo-Commit
    GET /cdn/{sha256}                         the LFS bytes, Range honoured

Every request is recorded (path, host, Authorization present or not, Range) so tests can check what was sent where.

A hub can lie, as a hostile mirror or HF_ENDPOINT would: `claims` lists another sha256 for a file than its bytes
have, `patch` overrides fields of a file's listing entry, `listing` replaces the whole listing body, `redirect`
sends resolves of LFS files to another base URL (a host the node does not allow) or, with "loop", back to
themselves forever.

    ensure(fetcher, "hf://org/name")          Fetcher.ensure as the admin: the one line that follows its signature
"""

from __future__ import annotations

import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.grants import admin
from weightcache.fetch import Fetcher
from weightcache.store import Snapshot
from weightcache.uri import parse_ref

COMMIT = "4f1c2d3e4f5a6b7c8d9e0f1a2b3c4d5e6f7a8b9c"


@dataclass
class Seen:
    method: str
    host: str
    path: str
    authorization: str | None
    range: str | None


@dataclass
class Repo:
    files: dict[str, bytes]
    private: bool = False
    commit: str = COMMIT

    @staticmethod
    def is_lfs(name: str) -> bool:
        return name.endswith(".safetensors")


@dataclass
class FakeHub:
    port: int
    token: str
    repos: dict[str, Repo] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    claims: dict[str, str] = field(default_factory=dict)  # file name -> the sha256 its listing claims
    patch: dict[str, dict[str, Any]] = field(default_factory=dict)  # file name -> listing fields replaced
    listing: bytes | None = None  # the listing's raw body instead of the repo's
    redirect: str | None = None  # base URL LFS resolves redirect to instead of the CDN, or "loop"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def add(self, repo_id: str, directory: Path, *, private: bool = False) -> Repo:
        files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
                 if p.is_file()}
        self.repos[repo_id] = Repo(files, private)
        return self.repos[repo_id]


def _blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's object id


def _handler(hub: FakeHub) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            path = self.path.split("?", 1)[0]
            hub.seen.append(Seen("GET", self.headers.get("Host", ""), path, self.headers.get("Authorization"),
                                 self.headers.get("Range")))
            if m := re.fullmatch(r"/api/models/(.+)/revision/([^/]+)", path):
                return self._info(m.group(1), m.group(2))
            if m := re.fullmatch(r"/(.+?)/resolve/([^/]+)/(.+)", path):
                return self._resolve(m.group(1), m.group(2), m.group(3))
            if m := re.fullmatch(r"/cdn/([0-9a-f]{64})", path):
                for repo in hub.repos.values():
                    for data in repo.files.values():
                        if hashlib.sha256(data).hexdigest() == m.group(1):
                            return self._bytes(data, {"ETag": f'"{m.group(1)}"'})
            return self._error(404, "EntryNotFound")

        def _repo(self, repo_id: str, rev: str) -> Repo | None:
            repo = hub.repos.get(repo_id)
            if repo is None or (repo.private and self.headers.get("Authorization") != f"Bearer {hub.token}"):
                self._error(401, "RepoNotFound", "Repository not found")
                return None
            if rev not in ("main", repo.commit):
                self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}")
                return None
            return repo

        def _info(self, repo_id: str, rev: str) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            siblings = []
            for name, data in repo.files.items():
                entry: dict[str, object] = {"rfilename": name, "size": len(data), "blobId": _blob_id(data)}
                if repo.is_lfs(name):
                    entry["lfs"] = {"sha256": hub.claims.get(name, hashlib.sha256(data).hexdigest()),
                                    "size": len(data), "pointerSize": 134}
                entry.update(hub.patch.get(name, {}))
                siblings.append(entry)
            body = {"_id": "0" * 24, "id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": repo.private,
                    "gated": False, "disabled": False, "downloads": 0, "likes": 0, "tags": [],
                    "lastModified": "2026-01-01T00:00:00.000Z", "createdAt": "2026-01-01T00:00:00.000Z",
                    "library_name": "transformers", "siblings": siblings}
            raw = json.dumps(body).encode() if hub.listing is None else hub.listing
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _resolve(self, repo_id: str, rev: str, name: str) -> None:
            repo = self._repo(repo_id, rev)
            if repo is None:
                return
            data = repo.files.get(name)
            if data is None:
                return self._error(404, "EntryNotFound")
            headers = {"X-Repo-Commit": repo.commit}
            if repo.is_lfs(name):
                sha = hashlib.sha256(data).hexdigest()
                self.send_response(302)
                location = f"{hub.redirect or f'http://localhost:{hub.port}'}/cdn/{sha}"
                self.send_header("Location", self.path if hub.redirect == "loop" else location)
                self.send_header("X-Linked-Etag", f'"{sha}"')
                self.send_header("X-Linked-Size", str(len(data)))
                for k, v in headers.items():
                    self.send_header(k, v)
                self.send_header("Content-Length", "0")
                self.end_headers()
                return None
            return self._bytes(data, {**headers, "ETag": f'"{_blob_id(data)}"'})

        def _bytes(self, data: bytes, headers: dict[str, str]) -> None:
            m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range") or "")
            start, end = (int(m.group(1)), int(m.group(2) or len(data) - 1)) if m else (0, len(data) - 1)
            end = min(end, len(data) - 1)
            self.send_response(206 if m else 200)
            for k, v in headers.items():
                self.send_header(k, v)
            self.send_header("Accept-Ranges", "bytes")
            if m:
                self.send_header("Content-Range", f"bytes {start}-{end}/{len(data)}")
            self.send_header("Content-Length", str(end - start + 1))
            self.end_headers()
            self.wfile.write(data[start:end + 1])

        def _error(self, status: int, code: str, message: str = "") -> None:
            raw = json.dumps({"error": message or code}).encode()
            self.send_response(status)
            self.send_header("X-Error-Code", code)
            self.send_header("X-Error-Message", message or code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

    return Handler


@pytest.fixture
def fake_hub() -> Iterator[FakeHub]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), BaseHTTPRequestHandler)
    hub = FakeHub(server.server_address[1], token="hf_" + "s3cr3t" * 6)
    server.RequestHandlerClass = _handler(hub)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield hub
    finally:
        server.shutdown()
        server.server_close()


def ensure(fetcher: Fetcher, uri: str) -> Snapshot:
    """`fetcher.ensure` of `uri` as the admin (a test is the node's admin): the one line to change when the
    fetch engine's signature does."""
    return fetcher.ensure(admin(parse_ref(uri)))
