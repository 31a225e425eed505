"""A forward proxy per source (a cluster keeping Dragonfly's dfdaemon in proxy mode for origin traffic): the s3
and hf sources' requests go through the configured proxy, and the daemon config chooses it per scheme or bucket."""

from __future__ import annotations

import http.client
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
import pytest
from safetensors.numpy import save_file

from tests.fixtures_hub import FakeHub
from tests.fixtures_s3 import S3
from tests.grants import admin
from weightcache.daemon.config import load_settings
from weightcache.errors import ConfigError
from weightcache.fetch import Fetcher
from weightcache.store import Store
from weightcache.uri import parse_ref

BODY = bytes(range(256)) * 4096
_HOP = {"connection", "keep-alive", "proxy-connection", "proxy-authorization", "transfer-encoding", "te", "upgrade"}


class ForwardProxy(http.server.ThreadingHTTPServer):
    """A plain HTTP forward proxy on 127.0.0.1 (absolute-form request targets), recording what passed."""

    daemon_threads = True

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str | None]] = []  # method, absolute URL, Range
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.url = f"http://127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: ForwardProxy
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def _relay(self) -> None:
        target = urlsplit(self.path)  # absolute form: http://host:port/path?query
        self.server.seen.append((self.command, self.path, self.headers.get("Range")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        conn = http.client.HTTPConnection(target.hostname or "", target.port or 80, timeout=30)
        try:
            headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
            path = target.path + (f"?{target.query}" if target.query else "")
            conn.request(self.command, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            payload = resp.read()
        finally:
            conn.close()
        self.send_response(resp.status, resp.reason)
        for k, v in resp.getheaders():
            if k.lower() not in _HOP and k.lower() != "content-length":
                self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload) if self.command != "HEAD" else
                                               resp.getheader("Content-Length") or 0))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(payload)

    do_GET = do_HEAD = _relay


@pytest.fixture
def proxy() -> Iterator[ForwardProxy]:
    server = ForwardProxy()
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_the_s3_source_reads_through_its_proxy(s3: S3, proxy: ForwardProxy, tmp_path: Path) -> None:
    s3.put("models", "m/w.bin", BODY, ChecksumAlgorithm="SHA256")
    store = Store(tmp_path / "store")
    snap = Fetcher(store, endpoint_url=s3.endpoint_url, proxy_url=proxy.url, chunk_size=256 << 10).ensure(admin(
        parse_ref("s3://models/m/")))
    assert (snap.path / "w.bin").read_bytes() == BODY
    ranged = [url for method, url, rng in proxy.seen if method == "GET" and rng and url.endswith("/models/m/w.bin")]
    assert ranged and all(url.startswith(s3.endpoint_url) for url in ranged)  # absolute form: a forward proxy
    assert any("list-type=2" in url for _, url, _ in proxy.seen)  # the listing too


def test_the_hf_source_reads_through_its_proxy(fake_hub: FakeHub, proxy: ForwardProxy, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The hub's listing, its resolve requests and the LFS redirects all go through the source's proxy (the
    sources' one connection pool, SourceOptions.http_pool)."""
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("WEIGHTCACHE_HF_REDIRECT_HOSTS", "localhost")  # the fake hub's CDN
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    save_file({"w": np.arange(1024, dtype=np.float32)}, str(model / "w.safetensors"))  # LFS: a CDN redirect
    repo = fake_hub.add("acme/tiny", model)
    snap = Fetcher(Store(tmp_path / "store"), proxy_url=proxy.url).ensure(admin(parse_ref("hf://acme/tiny")))
    assert {f.path: (snap.path / f.path).read_bytes() for f in snap.files} == repo.files
    urls = [url for _, url, _ in proxy.seen]
    assert any(url.startswith(f"{fake_hub.url}/api/models/acme/tiny") for url in urls)
    assert any("/resolve/" in url for url in urls) and any("/cdn/" in url for url in urls)
    assert len(fake_hub.seen) == len(proxy.seen), "every request to the hub came through the proxy"


def test_proxies_are_chosen_per_scheme_or_bucket() -> None:
    s = load_settings(None, env={}, flags={"proxies": {"s3": "http://127.0.0.1:65001",
                                                       "s3://special": "http://10.0.0.1:3128"}})
    assert s.fetch.proxy_for(parse_ref("s3://models/m/")) == "http://127.0.0.1:65001"
    assert s.fetch.proxy_for(parse_ref("s3://special/m/")) == "http://10.0.0.1:3128"
    assert s.fetch.proxy_for(parse_ref("gs://models/m/")) is None
    with pytest.raises(ConfigError, match="credentials") as err:
        load_settings(None, env={}, flags={"proxies": {"s3": "http://u:hunter2@proxy:3128"}})
    assert "hunter2" not in str(err.value)
    with pytest.raises(ConfigError, match="proxies"):
        load_settings(None, env={}, flags={"proxies": ["http://proxy:3128"]})
