"""Network failures below HTTP: refused connections, blackholed endpoints, DNS failures. Each is retried with
bounded backoff and then fails with a SourceError (exit 6) naming the endpoint without its userinfo."""

from __future__ import annotations

import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.command import weightcache
from weightcache import defaults
from weightcache.errors import RetriesExceededError
from weightcache.retry import MAX_BACKOFF
from weightcache.sources import ObjectInfo, SourceOptions, open_source
from weightcache.uri import parse_ref


@pytest.fixture(autouse=True)
def _credentials(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)


def _closed_port() -> int:
    """A port nothing listens on (bound, then closed: connecting is refused)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture
def blackhole() -> Iterator[str]:
    """A listening socket that never accepts or answers: connects succeed, requests hang."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(64)
    try:
        yield f"http://127.0.0.1:{s.getsockname()[1]}"
    finally:
        s.close()


def test_a_refused_connection_is_retried_then_fails_naming_the_endpoint() -> None:
    host = f"127.0.0.1:{_closed_port()}"
    src = open_source(parse_ref("s3://models/m/"), endpoint_url=f"http://{host}", max_attempts=3, backoff=0.01)
    try:
        with pytest.raises(RetriesExceededError, match="failed 3 times") as info:
            src.list()
    finally:
        src.close()
    assert host in str(info.value)


def test_an_http_range_read_from_a_refused_server_is_retried() -> None:
    url = f"http://127.0.0.1:{_closed_port()}/m/w.bin"
    src = open_source(parse_ref(url.rsplit("/", 1)[0] + "/"), max_attempts=3, backoff=0.01)
    with pytest.raises(RetriesExceededError, match="failed 3 times"):
        src.read_into(ObjectInfo(url, "w.bin", 10, None, None, None), 0, memoryview(bytearray(10)))


def test_an_http_listing_from_a_refused_server_is_retried_not_taken_for_an_empty_directory() -> None:
    src = open_source(parse_ref(f"http://127.0.0.1:{_closed_port()}/m/"), max_attempts=3, backoff=0.01)
    with pytest.raises(RetriesExceededError, match=r"listing .* failed 3 times"):
        src.list()


def test_a_blackholed_endpoint_times_out_each_attempt(blackhole: str) -> None:
    src = open_source(parse_ref("s3://models/m/"), endpoint_url=blackhole, max_attempts=2, backoff=0.01,
                      connect_timeout=0.5, read_timeout=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(RetriesExceededError, match=r"failed 2 times, last: .* timed out"):
            src.list()
    finally:
        src.close()
    assert time.monotonic() - started < 30


def test_a_dns_failure_is_retried_and_says_so() -> None:
    src = open_source(parse_ref("s3://models/m/"), endpoint_url="http://no-such-host.invalid:9000", max_attempts=2,
                      backoff=0.01)
    try:
        with pytest.raises(RetriesExceededError, match=r"no-such-host\.invalid"):
            src.list()
    finally:
        src.close()


def test_default_timeouts_fail_a_blackholed_endpoint_within_a_minute() -> None:
    o = SourceOptions()
    assert (o.connect_timeout, o.read_timeout) == (defaults.CONNECT_TIMEOUT, defaults.READ_TIMEOUT)
    pauses = sum(min(MAX_BACKOFF, o.backoff * 2 ** i) for i in range(o.max_attempts - 1))
    assert o.max_attempts * o.read_timeout + pauses < 60


@pytest.mark.e2e
def test_cli_prefetch_from_a_refused_endpoint_exits_6_without_traceback_or_userinfo(tmp_path: Path) -> None:
    host = f"127.0.0.1:{_closed_port()}"

    def prefetch(endpoint: str) -> subprocess.CompletedProcess[str]:
        return weightcache("prefetch", "--no-daemon", "s3://models/m/", "--root", str(tmp_path / "root"),
                           "--endpoint-url", endpoint, "--connect-timeout", "1")
    # credentials in the URL: refused before any connection (the one settings reader the daemon uses too)
    proc = prefetch(f"http://minio:hunter2@{host}")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "hunter2" not in proc.stderr
    assert "credentials do not belong in the URL" in proc.stderr
    proc = prefetch(f"http://{host}")
    assert proc.returncode == 6, proc.stderr
    assert "Traceback" not in proc.stderr
    assert host in proc.stderr and "check the network" in proc.stderr
