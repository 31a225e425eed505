"""The fault proxy itself: it forwards faithfully, records, and each fault does exactly what it says."""

from __future__ import annotations

import http.client
import socket
import time
from dataclasses import dataclass

import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_s3 import S3

BODY = bytes(range(256)) * 40  # 10240 bytes


@pytest.fixture
def proxy(s3: S3, fault_proxy: FaultProxy) -> FaultProxy:
    s3.put("bucket", "dir/obj.bin", BODY, ACL="public-read")  # plain, unsigned GETs below
    return fault_proxy


@dataclass(frozen=True)
class Reply:
    status: int
    headers: http.client.HTTPMessage
    body: bytes
    error: http.client.IncompleteRead | None


def get(proxy: FaultProxy, headers: dict[str, str] | None = None) -> Reply:
    conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=10)
    try:
        conn.request("GET", "/bucket/dir/obj.bin?x-id=GetObject", headers=headers or {})
        resp = conn.getresponse()
        try:
            return Reply(resp.status, resp.headers, resp.read(), None)
        except http.client.IncompleteRead as exc:
            return Reply(resp.status, resp.headers, exc.partial, exc)
    finally:
        conn.close()


def test_forwards_and_records(proxy: FaultProxy) -> None:
    assert get(proxy, {"Range": "bytes=10-19", "If-Match": '"abc"'}).status == 412  # moto saw the wrong ETag
    reply = get(proxy, {"Range": "bytes=10-19"})
    assert (reply.status, reply.body, reply.headers["Content-Range"]) == (206, BODY[10:20], "bytes 10-19/10240")
    first, second = proxy.requests
    assert (first.method, first.path, first.query, first.range, first.if_match) == (
        "GET", "/bucket/dir/obj.bin", "x-id=GetObject", "bytes=10-19", '"abc"')
    assert second.if_match is None


def test_faults_match_method_path_range_and_count(proxy: FaultProxy) -> None:
    fault = proxy.add("status", method="GET", path="obj.bin", ranged_only=True, count=2, status=500)
    assert get(proxy).status == 200  # not ranged
    proxy.add("status", method="PUT", status=418)  # other method
    assert [get(proxy, {"Range": "bytes=0-1"}).status for _ in range(3)] == [500, 500, 206]
    assert fault.fired == 2


def test_unknown_fault_is_refused(proxy: FaultProxy) -> None:
    with pytest.raises(ValueError, match="unknown fault 'drop'"):
        proxy.add("drop")


def test_slowdown_is_an_s3_503_with_retry_after(proxy: FaultProxy) -> None:
    proxy.add("slowdown", retry_after=3)
    reply = get(proxy)
    assert (reply.status, reply.headers["Retry-After"]) == (503, "3")
    assert b"<Code>SlowDown</Code>" in reply.body


def test_status_sends_the_given_code(proxy: FaultProxy) -> None:
    proxy.add("status", status=403, code="AccessDenied")
    reply = get(proxy)
    assert reply.status == 403
    assert b"<Code>AccessDenied</Code>" in reply.body


def test_truncate_promises_more_than_it_sends(proxy: FaultProxy) -> None:
    proxy.add("truncate", keep=0.25)
    reply = get(proxy)
    assert reply.headers["Content-Length"] == str(len(BODY))
    assert reply.error is not None
    assert reply.body == BODY[:len(BODY) // 4]


def test_reset_sends_an_rst(proxy: FaultProxy) -> None:
    proxy.add("reset", keep=0.5)
    with socket.create_connection(("127.0.0.1", proxy.port), timeout=10) as sock:
        sock.sendall(b"GET /bucket/dir/obj.bin HTTP/1.1\r\nHost: x\r\n\r\n")
        with pytest.raises(ConnectionResetError):
            while sock.recv(65536):
                pass


def test_flip_changes_exactly_one_byte(proxy: FaultProxy) -> None:
    proxy.add("flip", at=100)
    data = get(proxy).body
    assert len(data) == len(BODY)
    assert [i for i in range(len(BODY)) if data[i] != BODY[i]] == [100]


def test_delay_answers_late(proxy: FaultProxy) -> None:
    proxy.add("delay", seconds=0.3)
    start = time.monotonic()
    assert get(proxy).body == BODY
    assert time.monotonic() - start >= 0.3


def test_clear_forgets_requests_and_faults(proxy: FaultProxy) -> None:
    proxy.add("status", count=-1)
    get(proxy)
    proxy.clear()
    assert get(proxy).status == 200
    assert len(proxy.requests) == 1
