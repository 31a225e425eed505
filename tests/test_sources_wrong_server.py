"""Each scheme pointed at the wrong kind of server (a web server answering a 301 loop, or a 200 HTML page, as nginx,
an ingress or a MinIO console port do): exit 6 with one line saying what answered and what to check, never a
traceback, never a credential. gs:// and az:// run where their backends are installed (the object-store tier,
scripts/test_objstores.sh, runs this file too). Before: s3:// went through botocore's region redirector about 80
levels deep into a 2,986-line RecursionError traceback and exit 1; gs:// printed gcsfs's logged traceback."""

from __future__ import annotations

import http.server
import importlib.util
import os
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.command import weightcache

AZURE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
AWS_SECRET = "wrong-server-secret-do-not-print"
PAGE = b"<html><head><title>Welcome to nginx!</title></head><body>nginx</body></html>"


class _WebServer(http.server.BaseHTTPRequestHandler):
    status = 301

    def _answer(self) -> None:
        self.send_response(self.status)
        if self.status == 301:  # to itself: what an http->https or trailing-slash rule looks like to a client
            self.send_header("Location", f"http://127.0.0.1:{self.server.server_address[1]}{self.path}")
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(PAGE)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(PAGE)

    do_GET = do_HEAD = do_PUT = do_POST = _answer

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def web_server(request: pytest.FixtureRequest) -> Iterator[str]:
    """A web server answering every request with a 301 to itself, or with `status=200` an HTML page."""
    handler = type("Handler", (_WebServer,), {"status": getattr(request, "param", 301)})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _needs(package: str) -> pytest.MarkDecorator:
    """gs:// and az:// run in the object-store tier, which installs their backends (scripts/test_objstores.sh);
    the main suite keeps a node without them, to check the install hint it gives."""
    return pytest.mark.skipif(importlib.util.find_spec(package) is None, reason=f"{package}: the object-store tier")


def _env(url: str, home: Path) -> dict[str, str]:
    return {
        "PATH": "/usr/bin:/bin", "HOME": str(home), "KUBECONFIG": "/nonexistent",
        "WEIGHTCACHE_SOCKET": "/nonexistent/wc.sock",
        "AWS_ENDPOINT_URL": url, "AWS_ACCESS_KEY_ID": "AKIAWRONGSERVER", "AWS_SECRET_ACCESS_KEY": AWS_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": "/dev/null", "AWS_SHARED_CREDENTIALS_FILE": "/dev/null",
        "STORAGE_EMULATOR_HOST": url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "AZURE_STORAGE_CONNECTION_STRING": (f"DefaultEndpointsProtocol=http;AccountName=devstoreaccount1;"
                                            f"AccountKey={AZURE_KEY};BlobEndpoint={url}/devstoreaccount1;"),
        "HF_ENDPOINT": url, "HF_HUB_DISABLE_TELEMETRY": "1",
        # the checkout under test, where it is not the one installed (a git worktree)
        **{k: v for k, v in os.environ.items() if k == "PYTHONPATH"},
    }


@pytest.mark.e2e
@pytest.mark.parametrize(("ref", "says"), [
    ("s3://models/tiny/", "did not answer like S3"),
    pytest.param("gs://models/tiny/", "did not answer like Google Cloud Storage", marks=_needs("gcsfs")),
    pytest.param("az://models/tiny/", "did not answer like Azure Blob Storage", marks=_needs("adlfs")),
    ("http://{host}/models/tiny/", "http://"),
    ("oci://{host}/models/tiny:v1", "{host}"),  # a redirect loop, or no JSON manifest, from that registry
    ("hf://org/tiny", "org/tiny"),
])
def test_each_scheme_at_a_web_server_exits_6_with_what_to_check(web_server: str, ref: str, says: str,
                                                                 tmp_path: Path) -> None:
    host = web_server.removeprefix("http://")
    ref, says = ref.format(host=host), says.format(host=host)
    done = weightcache("prefetch", ref, "--root", str(tmp_path / "root"), "-q", env=_env(web_server, tmp_path))
    assert done.returncode == 6, done.stderr[-3000:]
    assert "Traceback" not in done.stderr and len(done.stderr.splitlines()) == 1, done.stderr[-3000:]
    assert says in done.stderr
    assert AWS_SECRET not in done.stderr and AZURE_KEY not in done.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("web_server", [200], indirect=True)
@pytest.mark.parametrize(("ref", "says"), [
    ("s3://models/tiny/", "no ListBucketResult"),  # it listed as an empty bucket: "no objects under ..."
    pytest.param("gs://models/tiny/", "did not answer like Google Cloud Storage", marks=_needs("gcsfs")),
    pytest.param("az://models/tiny/", "did not answer like Azure Blob Storage", marks=_needs("adlfs")),
])
def test_a_web_page_is_no_object_store_listing(web_server: str, ref: str, says: str, tmp_path: Path) -> None:
    test_each_scheme_at_a_web_server_exits_6_with_what_to_check(web_server, ref, says, tmp_path)


@pytest.mark.e2e
@pytest.mark.parametrize("web_server", [404, 403], indirect=True)
def test_a_web_servers_error_page_is_no_missing_bucket(web_server: str, tmp_path: Path) -> None:
    """nginx answers a path it does not serve with a 404 (or 403) HTML page: no S3 error code in it, so the
    listing says the endpoint is no S3, not that the bucket is missing or the credentials are wrong. Before
    (real nginx 1.22 at --endpoint-url): "404 (HTTP 404); check that the bucket and prefix exist"."""
    test_each_scheme_at_a_web_server_exits_6_with_what_to_check(web_server, "s3://models/tiny/",
                                                                "did not answer like S3", tmp_path)
