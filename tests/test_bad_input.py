"""Every bad input is a 4xx saying what to send instead, never a 500: the daemon API (real daemon on a Unix
socket, hypothesis-fuzzed bodies) and the webhook (a malformed review is HTTP 400; a well-formed review of a
malformed pod is an AdmissionReview denial, which the API server shows to the user)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient, TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures_daemon import RunningDaemon
from tests.fixtures_webhook import admission_review, deployment_pod
from weightcache.csi.reconcile import VolumeBook, VolumeRecord
from weightcache.webhook.server import Policy, make_app

DEEP = b"[" * 100_000 + b"]" * 100_000
HUGE_INT = b'{"uri": "s3://models/x/", "pin": ' + b"7" * 4301 + b"}"


def deep_object(depth: int) -> bytes:
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize(("body", "says"), [
    (DEEP, "nested deeper than 64 levels"),
    (deep_object(200), "nested deeper than 64 levels"),
    (HUGE_INT, "is not valid JSON"),
    (b"\xff\xfe{}", "is not"),
    (b"{", "is not valid JSON"),
])
@pytest.mark.parametrize(("method", "path"), [("PUT", "/v1/models"), ("POST", "/v1/leases")])
async def test_hostile_bodies_are_400_with_what_to_send(daemon: RunningDaemon, method: str, path: str,
                                                         body: bytes, says: str) -> None:
    async with daemon.http() as http, http.request(method, path, data=body) as r:
        answer = await r.json()
        assert r.status == 400, answer
        assert says in answer["message"] and "send JSON like" in answer["message"]


@pytest.mark.parametrize("path", ["/v1/leases/..", "/v1/leases/%2e%2e", "/v1/leases/..%2F..%2Fetc",
                                  "/v1/leases/a%00b", "/v1/models/..", "/v1/models/%2e%2e%2findex.db"])
async def test_path_tricks_are_4xx_never_500(daemon: RunningDaemon, path: str) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(daemon.socket))
    try:  # a raw request: aiohttp's client would normalise the path before sending it
        request = f"DELETE {path} HTTP/1.1\r\nHost: d\r\nConnection: close\r\n\r\n".encode()
        await asyncio.to_thread(sock.sendall, request)
        raw = await asyncio.to_thread(_read_all, sock)
    finally:
        sock.close()
    status = int(raw.split(b" ", 2)[1])
    assert 400 <= status < 500, raw[:300]
    assert (daemon.root / "index.db").exists()


def _read_all(sock: socket.socket) -> bytes:
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


async def test_csi_leases_cannot_be_released_through_the_api(daemon: RunningDaemon) -> None:
    snap = await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    store = daemon.daemon.node.store  # type: ignore[union-attr]
    VolumeBook(store.root).put(VolumeRecord("vol-1", "/kubelet/pods/u1/volumes/kubernetes.io~csi/m/mount",
                                            daemon.model_uri, snap["id"], pod_namespace="ml", pod_name="vllm-0",
                                            pod_uid="u1"))
    await asyncio.to_thread(store.lease, "csi:vol-1", snap["id"])
    async with daemon.http() as http:
        async with http.delete("/v1/leases/csi:vol-1") as r:
            answer = await r.json()
            assert r.status == 409, answer
            assert "ml/vllm-0" in answer["message"] and "delete the pod" in answer["message"]
        async with http.delete(f"/v1/models/{snap['id']}") as r:
            assert r.status == 409  # the model stays: the pod still reads it
    assert (await asyncio.to_thread(daemon.client.leases)) == {"csi:vol-1": snap["id"]}


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
field_values = st.one_of(json_values, st.sampled_from(["s3://models/x/", "file:///proc/", "disk", "memory", "*.bin"]))
api_bodies = st.one_of(
    json_values,
    st.fixed_dictionaries({}, optional=dict.fromkeys(("uri", "revision", "include", "exclude", "tier", "pin",
                                                      "namespace", "holder", "snapshot"), field_values)),
)


async def test_fuzzed_api_bodies_never_get_a_500(daemon: RunningDaemon) -> None:
    socket_path = str(daemon.socket)

    @settings(max_examples=120, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(body=api_bodies, route=st.sampled_from([("PUT", "/v1/models"), ("POST", "/v1/leases")]))
    def fuzz(body: Any, route: tuple[str, str]) -> None:
        conn = _UnixHTTP(socket_path)
        try:
            conn.request(route[0], route[1], json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            answer = json.loads(response.read())
        finally:
            conn.close()
        assert response.status < 500, (body, answer)
        if response.status >= 400:
            assert answer["error"] and answer["message"], answer

    await asyncio.to_thread(fuzz)


class _UnixHTTP(http.client.HTTPConnection):
    def __init__(self, path: str) -> None:
        super().__init__("localhost", timeout=30)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.connect(self._path)


# -- the webhook -----------------------------------------------------------------------------------------------
@pytest.fixture
async def webhook() -> AsyncIterator[TestClient[Any, Any]]:
    client = TestClient(TestServer(make_app(Policy(model_caches=list, allow_undeclared=True)), host="127.0.0.1"))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()


def annotated_pod(**changes: Any) -> dict[str, Any]:
    pod = deployment_pod(annotations={"weightcache.io/model": "s3://models/llama-3-8b/"})
    for path, value in changes.items():
        target = pod
        *parents, last = path.split(".")
        for part in parents:
            target = target[int(part)] if isinstance(target, list) else target[part]
        target[last] = value
    return pod


@pytest.mark.parametrize("body", [
    b'{"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", "request": {"uid": ' + b"1" * 4301 + b"}}",
    DEEP,
    deep_object(500),
    b"\xff" * 10,
])
async def test_an_unreadable_review_is_http_400(webhook: TestClient[Any, Any], body: bytes) -> None:
    r = await webhook.post("/mutate", data=body)
    answer = await r.json()
    assert r.status == 400, answer
    assert answer["error"] == "bad_request" and "send JSON like" in answer["message"]


@pytest.mark.parametrize("changes", [
    {"spec.volumes": [{"name": ["a", "list"], "emptyDir": {}}]},
    {"spec.containers.0.env": [{"name": ["X"], "value": "1"}]},
    {"spec.volumes": "not a list"},
    {"spec.containers.0.env": [["X", "1"]]},
    {"metadata.annotations": {"weightcache.io/model": ["s3://models/llama-3-8b/"]}},
])
async def test_a_malformed_pod_is_a_denial_the_user_sees(webhook: TestClient[Any, Any],
                                                         changes: dict[str, Any]) -> None:
    review = admission_review(annotated_pod(**changes))
    r = await webhook.post("/mutate", json=review)
    answer = await r.json()
    assert r.status == 200, answer
    response = answer["response"]
    assert response["uid"] == review["request"]["uid"] and response["allowed"] is False
    assert response["status"]["code"] == 400 and response["status"]["message"]


async def test_a_list_used_as_a_name_in_the_request_is_a_bad_request(webhook: TestClient[Any, Any]) -> None:
    review = admission_review(annotated_pod())
    review["request"]["uid"] = ["not", "a", "uid"]
    r = await webhook.post("/mutate", json=review)
    assert r.status == 400
    assert "uid" in (await r.json())["message"]


@pytest.mark.parametrize(("method", "path", "status", "says"), [
    ("GET", "/v1/nothing-here", 404, "GET /v1/models"),
    ("POST", "/v1/models", 405, "this path takes"),
    ("PATCH", "/v1/leases/x", 405, "DELETE"),
])
async def test_unknown_routes_and_methods_say_what_exists(daemon: RunningDaemon, method: str, path: str, status: int,
                                                          says: str) -> None:
    async with daemon.http() as http, http.request(method, path, data=b"{}") as r:
        answer = await r.json()
    assert r.status == status and says in answer["message"], answer


async def test_a_body_over_1_mib_is_413_saying_the_limit(daemon: RunningDaemon) -> None:
    async with daemon.http() as http, http.put("/v1/models", data=b"[" + b"0," * 600_000 + b"0]") as r:
        answer = await r.json()
    assert r.status == 413 and "at most 1 MiB" in answer["message"], answer
