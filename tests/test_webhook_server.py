"""The webhook over real HTTPS on 127.0.0.1, with certificates made here, called the way kube-apiserver calls it:
POST /mutate?timeout=10s to https://<svc>.<ns>.svc (SNI), trusting only the caBundle."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import resource
import signal
import socket
import ssl
import subprocess
import threading
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from tests.command import start_weightcache
from tests.fake_apiserver import FakeApiServer, model_cache
from tests.fixtures_daemon import eventually
from tests.fixtures_webhook import REF, admission_review, apply_response, check_pod, container, deployment_pod
from weightcache.listener import ConnectionLimits, GuardedTCPSite
from weightcache.pods.annotations import MAX_ANNOTATION_CHARS, MAX_MODELS
from weightcache.webhook import server
from weightcache.webhook.certs import CertPair, make_ca, make_serving_cert, service_dns_names, write_service_certs
from weightcache.webhook.server import Policy, Running, make_app, start

SERVICE, NAMESPACE = "weightcache-webhook", "weightcache-system"
SNI = f"{SERVICE}.{NAMESPACE}.svc"


def write_pair(folder: Path, pair: CertPair) -> tuple[Path, Path]:
    """Write a pair the way kubelet updates a Secret volume: a new timestamped dir, then swap the ..data link."""
    stamp = folder / f"..{time.monotonic_ns()}"
    stamp.mkdir()
    (stamp / "tls.crt").write_bytes(pair.cert_pem)
    (stamp / "tls.key").write_bytes(pair.key_pem)
    tmp = folder / "..data_tmp"
    tmp.symlink_to(stamp.name)
    os.replace(tmp, folder / "..data")
    for name in ("tls.crt", "tls.key"):
        if not (folder / name).is_symlink():
            (folder / name).symlink_to(f"..data/{name}")
    return folder / "tls.crt", folder / "tls.key"


def client_context(ca: CertPair) -> ssl.SSLContext:
    return ssl.create_default_context(cadata=ca.cert_pem.decode())


@pytest.fixture
async def webhook(tmp_path: Path) -> AsyncIterator[tuple[Running, CertPair, Path]]:
    ca = make_ca()
    cert, key = write_pair(tmp_path, make_serving_cert(ca, service_dns_names(SERVICE, NAMESPACE)))
    running = await start(
        make_app(Policy(model_caches=list, allow_undeclared=True)), cert=cert, key=key, host="127.0.0.1", port=0
    )
    try:
        yield running, ca, tmp_path
    finally:
        await running.stop()


async def call(port: int, ca: CertPair, body: bytes | Any, path: str = "/mutate?timeout=10s") -> tuple[int, Any]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"https://127.0.0.1:{port}{path}",
            data=data,
            ssl=client_context(ca),
            server_hostname=SNI,
            headers={"Content-Type": "application/json"},
        ) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def get(port: int, ca: CertPair, path: str) -> tuple[int, str]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"https://127.0.0.1:{port}{path}", ssl=client_context(ca), server_hostname=SNI) as resp,
    ):
        return resp.status, await resp.text()


async def test_review_over_https_returns_a_patch_the_api_server_can_apply(webhook: Any) -> None:
    running, ca, _ = webhook
    pod = deployment_pod({"weightcache.io/model": REF})
    request = admission_review(pod)
    status, answer = await call(running.port, ca, request)
    assert status == 200
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    response = answer["response"]
    assert response["uid"] == request["request"]["uid"] and response["allowed"] is True
    assert response["patchType"] == "JSONPatch"
    assert isinstance(json.loads(base64.b64decode(response["patch"], validate=True)), list)
    check_pod(apply_response(pod, answer))


async def test_denial_is_http_200_with_allowed_false(webhook: Any) -> None:
    running, ca, _ = webhook
    request = admission_review(deployment_pod({"weightcache.io/model": REF, "weightcache.io/tier": "nvme"}))
    status, answer = await call(running.port, ca, request)
    assert status == 200
    assert (
        answer["response"]["allowed"] is False
        and "weightcache.io/tier: disk" in answer["response"]["status"]["message"]
    )


@pytest.mark.parametrize(
    "body",
    [
        b"{not json",
        b"\xff\xfe",
        b"[" * 100_000,
        {"apiVersion": "admission.k8s.io/v1beta1", "kind": "AdmissionReview", "request": {"uid": "x"}},
        {
            **admission_review(deployment_pod()),
            "request": {**admission_review(deployment_pod())["request"], "operation": "DELETE"},
        },
    ],
)
async def test_bad_request_is_a_clear_400_never_500(webhook: Any, body: Any) -> None:
    running, ca, _ = webhook
    status, answer = await call(running.port, ca, body)
    assert status == 400
    assert answer["error"] == "bad_request" and answer["message"]


async def test_healthz_and_metrics_count_outcomes(webhook: Any) -> None:
    running, ca, _ = webhook
    await call(running.port, ca, admission_review(deployment_pod({"weightcache.io/model": REF})))
    await call(running.port, ca, admission_review(deployment_pod()))
    await call(running.port, ca, b"nope")
    await call(running.port, ca, admission_review(deployment_pod({"weightcache.io/model": "nope"})))
    assert await get(running.port, ca, "/healthz") == (200, "ok")
    status, text = await get(running.port, ca, "/metrics")
    assert status == 200
    for outcome in ("patched", "unchanged", "bad_request", "denied"):
        assert f'weightcache_webhook_reviews_total{{outcome="{outcome}"}} 1.0' in text
    assert "weightcache_webhook_review_seconds_count 4.0" in text


async def test_untrusted_or_plain_clients_cannot_talk(webhook: Any) -> None:
    running, _, _ = webhook
    with pytest.raises(aiohttp.ClientConnectorCertificateError):
        await get(running.port, make_ca(), "/healthz")
    async with aiohttp.ClientSession() as session:
        with pytest.raises(aiohttp.ClientError):
            async with session.get(f"http://127.0.0.1:{running.port}/healthz") as resp:
                await resp.read()


async def wait_for(predicate: Any, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not await predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.05)


async def test_rotated_certificate_is_served_without_restart(webhook: Any) -> None:
    running, old_ca, folder = webhook
    new_ca = make_ca("rotated-ca")

    async def serves(ca: CertPair) -> bool:
        try:
            return (await get(running.port, ca, "/healthz"))[0] == 200
        except aiohttp.ClientConnectorCertificateError:
            return False

    # a half-written rotation (new cert, old key) does not load: the old pair stays in use
    old_key = (folder / "tls.key").read_bytes()
    write_pair(folder, CertPair(make_serving_cert(new_ca, [SNI]).cert_pem, old_key))
    await wait_for(lambda: _reloads(running.port, old_ca, "failed"))
    assert await serves(old_ca)

    write_pair(folder, make_serving_cert(new_ca, service_dns_names(SERVICE, NAMESPACE)))
    await wait_for(lambda: serves(new_ca))
    assert not await serves(old_ca)
    assert await _reloads(running.port, new_ca, "ok", count=1), "one rotation, one reload, however many events"


async def _reloads(port: int, ca: CertPair, result: str, count: int | None = None) -> bool:
    _, text = await get(port, ca, "/metrics")
    line = f'weightcache_webhook_cert_reloads_total{{result="{result}"}}'
    return f"{line} {count}.0" in text if count is not None else line in text


def run_command(*args: str, **kwargs: Any) -> subprocess.Popen[str]:
    """The real entry point, as the Deployment runs it: `weightcache webhook ...`."""
    return start_weightcache(*args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def serve(certs: Path, *flags: str, **kwargs: Any) -> subprocess.Popen[str]:
    """`weightcache webhook` on 127.0.0.1, a free port, with the pair in `certs` (tls.crt, tls.key)."""
    return run_command("webhook", "--cert", str(certs / "tls.crt"), "--key", str(certs / "tls.key"),
                       "--host", "127.0.0.1", "--port", "0", *flags, **kwargs)


async def listening(proc: subprocess.Popen[str]) -> str:
    """The command's "webhook listening on https://HOST:PORT/mutate" line (log lines may come first)."""
    assert proc.stderr is not None
    for _ in range(100):
        line = await asyncio.to_thread(proc.stderr.readline)
        if "webhook listening on https://127.0.0.1:" in line or not line:
            return line
    raise AssertionError("the webhook never said where it listens")


@pytest.mark.e2e
async def test_command_serves_until_sigterm(tmp_path: Path) -> None:
    certs = run_command("webhook", "certs", "--service", SERVICE, "--namespace", NAMESPACE, "--out", str(tmp_path))
    out, err = certs.communicate(timeout=60)
    assert certs.returncode == 0, err
    ca = CertPair(base64.b64decode(out.strip()))
    assert ca.cert_pem == (tmp_path / "ca.crt").read_bytes()
    assert "kubectl" in err and "BEGIN" not in err and "PRIVATE" not in out + err

    proc = serve(tmp_path, "--no-allow-undeclared")
    try:
        line = await listening(proc)
        assert "allow undeclared models: False" in line
        port = int(line.split("127.0.0.1:")[1].split("/")[0])
        status, answer = await call(port, ca, admission_review(deployment_pod({"weightcache.io/model": REF})))
        assert status == 200 and answer["response"]["allowed"] is False
        assert "no ModelCache declares" in answer["response"]["status"]["message"]
    finally:
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.communicate, None, 30)
    assert proc.returncode == 0


@pytest.mark.e2e
def test_command_explains_missing_or_bad_certificates(tmp_path: Path) -> None:
    proc = run_command("webhook", "--port", "0")
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "--cert FILE and --key FILE" in err and "webhook certs" in err

    write_service_certs(tmp_path, service=SERVICE, namespace=NAMESPACE)
    proc = run_command(
        "webhook",
        "--cert",
        str(tmp_path / "tls.crt"),
        "--key",
        str(tmp_path / "ca.crt"),
        "--host",
        "127.0.0.1",
        "--port",
        "0",
    )
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and "matching PEM pair" in err and "Traceback" not in err


async def test_readyz_waits_for_the_modelcache_list(tmp_path: Path) -> None:
    ca = make_ca()
    cert, key = write_pair(tmp_path, make_serving_cert(ca, [SNI]))
    synced = False
    running = await start(
        make_app(Policy(model_caches=list, allow_undeclared=False, synced=lambda: synced)),
        cert=cert,
        key=key,
        host="127.0.0.1",
        port=0,
    )
    try:
        assert (await get(running.port, ca, "/readyz"))[0] == 503
        assert (await get(running.port, ca, "/healthz")) == (200, "ok")
        synced = True
        assert (await get(running.port, ca, "/readyz")) == (200, "ok")
    finally:
        await running.stop()


@pytest.mark.e2e
async def test_command_in_cluster_mode_follows_modelcaches(apiserver: FakeApiServer, tmp_path: Path) -> None:
    """Cluster mode through a kubeconfig: the ModelCache watcher feeds the shared policy, live."""
    api = apiserver
    write_service_certs(tmp_path, service=SERVICE, namespace=NAMESPACE)
    ca = CertPair((tmp_path / "ca.crt").read_bytes())
    api.create("modelcaches", model_cache("llama", REF, allowedNamespaces=["inference"]))
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "fake",
                "clusters": [{"name": "fake", "cluster": {"server": api.url}}],
                "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "webhook"}}],
                "users": [{"name": "webhook", "user": {"token": "not-a-real-token"}}],
            }
        )
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_")} | {"KUBECONFIG": str(kubeconfig)}
    proc = serve(tmp_path, env=env)
    try:
        line = await listening(proc)
        assert "allow undeclared models: False" in line, line
        port = int(line.split("127.0.0.1:")[1].split("/")[0])
        await wait_for(lambda: _ok(get(port, ca, "/readyz")))

        async def allowed(namespace: str, ref: str = REF) -> bool:
            pod = deployment_pod({"weightcache.io/model": ref})
            _, answer = await call(port, ca, admission_review(pod, namespace=namespace))
            return bool(answer["response"]["allowed"])

        assert await allowed("inference")
        assert not await allowed("research")
        api.create("modelcaches", model_cache("shared", "s3://models/shared/", allowedNamespaces=["*"]))
        await wait_for(lambda: allowed("research", "s3://models/shared/"))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, None, 30)
    assert proc.returncode == 0, err
    assert "not-a-real-token" not in err


async def _ok(request: Any) -> bool:
    return (await request)[0] == 200


# -- Hardening III: the TLS listener is guarded, and a review is bounded ------------------------------------------

SMALL = ConnectionLimits(max_connections=8, header_timeout_s=1.0, body_timeout_s=10.0,  # 7 MB bodies
                         idle_timeout_s=3.0)
CACHES = [  # 200 ModelCaches over 50 sources, as in the report
    {"metadata": {"name": f"mc{i}"},
     "spec": {"source": f"s3://models/m{i % 50}/", "allowedNamespaces": ["inference", f"team-{i}"]}}
    for i in range(200)
]


class ReviewGate:
    """The webhook's ModelCaches lookup, which a review makes from wherever it runs: open, it answers at once;
    `hold()` keeps each review that reaches it there until `release()`, counted in `inside`."""

    def __init__(self) -> None:
        self.inside = 0
        self._open = threading.Event()
        self._open.set()
        self._lock = threading.Lock()

    def hold(self) -> None:
        self._open.clear()

    def release(self) -> None:
        self._open.set()

    def model_caches(self) -> list[dict[str, Any]]:
        with self._lock:
            self.inside += 1
        try:
            assert self._open.wait(120), "the review gate was never released"
            return CACHES
        finally:
            with self._lock:
                self.inside -= 1


@pytest.fixture
def review_gate() -> ReviewGate:
    return ReviewGate()


@pytest.fixture
async def guarded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                  review_gate: ReviewGate) -> AsyncIterator[tuple[Running, CertPair]]:
    """A webhook with 200 ModelCaches (looked up through `review_gate`), undeclared models refused, and the small
    listener limits above."""
    monkeypatch.setattr(server, "LIMITS", SMALL)
    ca = make_ca()
    cert, key = write_pair(tmp_path, make_serving_cert(ca, service_dns_names(SERVICE, NAMESPACE)))
    running = await start(make_app(Policy(model_caches=review_gate.model_caches, allow_undeclared=False)),
                          cert=cert, key=key, host="127.0.0.1", port=0)
    try:
        yield running, ca
    finally:
        await running.stop()


def _site(running: Running) -> GuardedTCPSite:
    (site,) = [s for s in running.runner.sites if isinstance(s, GuardedTCPSite)]
    return site


def _read_all(sock: socket.socket, seconds: float) -> bytes:
    sock.settimeout(seconds)
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except (ConnectionResetError, ssl.SSLError):
        pass
    return b"".join(chunks)


async def test_half_open_tls_connections_cannot_take_the_webhook(guarded: Any) -> None:
    """Hardening III: the webhook (failurePolicy Fail) had no guard. 100 connections that never finish a TLS
    handshake (half send a partial ClientHello): the webhook holds at most its cap, keeps answering real clients
    (whose connections take the half-open ones' slots) and closes every half-open one at the deadline. The flood
    is held open (a handshake deadline no test outlasts) while the real client is answered, so the answer is the
    cap's and the shedding's doing, never a deadline that happened to fire; a second flood under the 1 s deadline
    then sheds what is held and is cut."""
    running, ca = guarded
    site = _site(running)
    baseline = len(os.listdir("/proc/self/fd"))

    def flood(n: int) -> list[socket.socket]:
        socks = []
        for i in range(n):
            sock = socket.create_connection(("127.0.0.1", running.port), timeout=10)
            if i % 2:
                sock.sendall(b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03")  # a ClientHello that stops there
            socks.append(sock)
        return socks

    def counts() -> tuple[int, int, int, int]:
        return site.stats.shed, site.stats.refused, site.stats.header_timeouts, site.stats.handshake_failures

    site.limits = replace(SMALL, header_timeout_s=600)  # read at each accept: the held flood's deadline
    held = await asyncio.to_thread(flood, 100)
    cut: list[socket.socket] = []
    try:
        await eventually(lambda: site.stats.shed == 100 - SMALL.max_connections, what="every accept")
        assert site.stats.active == SMALL.max_connections
        fds = len(os.listdir("/proc/self/fd")) - baseline - len(held)  # the test's own sockets aside
        assert fds <= SMALL.max_connections + 8, fds
        assert await get(running.port, ca, "/healthz") == (200, "ok")  # answered while the flood holds the cap
        assert counts() == (100 - SMALL.max_connections + 1, 0, 0, 0)  # its connection took a half-open one's slot

        await eventually(lambda: (site.stats.active, site.stats.closing) == (SMALL.max_connections - 1, 0),
                         what="the real client's slot free")
        site.limits = SMALL
        cut = await asyncio.to_thread(flood, SMALL.max_connections)
        answers = await asyncio.gather(*(asyncio.to_thread(_read_all, s, 60) for s in held + cut))
        assert all(a == b"" for a in answers)  # closed (no plaintext 408 on a TLS port), none left hanging
        shed, refused, timeouts, failed = counts()  # the held ones shed, the rest cut at the deadline (the guard's
        assert (shed, refused, timeouts + failed) == (100, 0, SMALL.max_connections)  # or asyncio's handshake's)
    finally:
        for sock in held + cut:
            sock.close()


async def test_tls_requests_whole_or_trickled_after_the_handshake(guarded: Any) -> None:
    """Through the guard over TLS: a request sent right behind the handshake is served; one whose headers
    trickle after a completed handshake is answered 408 over TLS at the deadline."""
    running, ca = guarded
    context = client_context(ca)

    def exchange(raw: bytes) -> bytes:
        with context.wrap_socket(socket.create_connection(("127.0.0.1", running.port), timeout=10),
                                 server_hostname=SNI) as tls:
            tls.sendall(raw)
            return _read_all(tls, SMALL.header_timeout_s + 5)

    whole = await asyncio.to_thread(exchange, b"GET /healthz HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n")
    assert whole.startswith(b"HTTP/1.1 200") and whole.endswith(b"ok")
    cut = await asyncio.to_thread(exchange, b"POST /mutate HTTP/1.1\r\nHost: w\r\nX-Slow: ")
    assert cut.startswith(b"HTTP/1.1 408") and b"did not arrive within 1s" in cut  # the header deadline's answer


async def test_a_huge_annotation_is_denied_at_once_with_a_clear_message(guarded: Any) -> None:
    """Hardening III: a 301 KB annotation with 200 ModelCaches took 2.4-3.7 s of the event loop. Now it is a
    denial before anything is parsed, and so is a short annotation of more models than a pod may mount."""
    running, ca = guarded
    huge = ",".join(f"n{i}=s3://models/bucket-{i}/prefix/" for i in range(9000))  # 340 KB
    status, answer = await call(running.port, ca, admission_review(deployment_pod({"weightcache.io/models": huge})))
    assert status == 200 and answer["response"]["allowed"] is False
    message = answer["response"]["status"]["message"]  # the size check's words: it runs before any parsing
    assert f"more than the {MAX_ANNOTATION_CHARS} a pod may use" in message and "at most 16 models" in message
    many = ",".join(f"n{i}=s3://models/m{i}/" for i in range(MAX_MODELS + 1))
    status, answer = await call(running.port, ca, admission_review(deployment_pod({"weightcache.io/models": many})))
    assert answer["response"]["allowed"] is False and answer["response"]["status"]["code"] == 400
    assert (f"names {MAX_MODELS + 1} models; a pod may mount at most {MAX_MODELS} (the webhook's --max-models)"
            in answer["response"]["status"]["message"])
    at_cap = ",".join(f"n{i}=s3://models/m{i}/" for i in range(MAX_MODELS))
    status, answer = await call(running.port, ca, admission_review(deployment_pod({"weightcache.io/models": at_cap})))
    assert answer["response"]["allowed"] is True and "patch" in answer["response"]


def _maximal_review() -> bytes:
    """The most a review may cost: 16 models (the cap) and a pod of ~7 MB (MAX_BODY is 8 MiB) whose container
    already has 95,000 env vars, each compared with what is injected."""
    models = ",".join(f"m{i}=s3://models/m{i}/" for i in range(MAX_MODELS))
    env = [{"name": f"VAR_{i}", "value": "x" * 40} for i in range(95_000)]
    pod = deployment_pod({"weightcache.io/models": models}, containers=[container("server", env=env)])
    return json.dumps(admission_review(pod)).encode()


async def test_healthz_keeps_answering_while_maximal_reviews_run(guarded: Any, review_gate: ReviewGate) -> None:
    """Hardening III: /healthz waited up to 3 s behind one review. Two maximal reviews (about a second of CPU
    each, on the loop before) run off the event loop: with the first held inside its review (at the ModelCaches
    lookup, after the 7 MB body was read and parsed) and the second queued behind it, liveness answers over the
    same TLS listener, again and again; a review on the loop would hold it (and this test's client) until
    released."""
    running, ca = guarded
    body = await asyncio.to_thread(_maximal_review)
    assert len(body) < server.MAX_BODY
    review_gate.hold()
    reviews = asyncio.gather(*(call(running.port, ca, body) for _ in range(2)))
    try:
        await eventually(lambda: review_gate.inside == 1, timeout=60, what="a review held at the gate")
        context = client_context(ca)  # one context: one kept-alive connection
        async with aiohttp.ClientSession() as session:
            for _ in range(3):
                async with session.get(f"https://127.0.0.1:{running.port}/healthz", ssl=context,
                                       server_hostname=SNI) as resp:
                    assert resp.status == 200 and await resp.text() == "ok"
        assert review_gate.inside == 1 and not reviews.done(), "answered while the review was held"
    finally:
        review_gate.release()
    for status, answer in await reviews:
        assert status == 200 and answer["response"]["allowed"] is True and "patch" in answer["response"]


# -- Hardening IV: shed TLS connections give their descriptors back ------------------------------------------------

TLS_SHUTDOWN_S = 30  # asyncio's default ssl_shutdown_timeout: how long a close()d TLS connection held its fd
NOFILE = 512  # the descriptor limit the webhook runs under here; its listener holds at most 256 connections


def _low_nofile() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _descriptors(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


@pytest.mark.e2e
async def test_shed_tls_connections_free_their_descriptors_under_a_low_ulimit(tmp_path: Path) -> None:
    """Hardening IV: a shed (or timed-out) TLS connection was closed with `transport.close()`, which waits up to
    30 s for the client's TLS close_notify: 700 clients that finish a handshake and half-send their headers (and
    never read) took the webhook, under `ulimit -n 512`, to its last descriptor, and a fresh /healthz handshake
    timed out. Shed connections are now aborted: the webhook holds about its cap and answers at once."""
    write_service_certs(tmp_path, service=SERVICE, namespace=NAMESPACE)
    ca = CertPair((tmp_path / "ca.crt").read_bytes())
    proc = serve(tmp_path, preexec_fn=_low_nofile)
    context = client_context(ca)
    socks: list[ssl.SSLSocket] = []
    try:
        line = await listening(proc)
        port = int(line.split("127.0.0.1:")[1].split("/")[0])

        def half_sent() -> None:
            try:
                tls = context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                                          server_hostname=SNI)
                tls.sendall(b"POST /mutate HTTP/1.1\r\nHost: w\r\nX-Slow: ")  # and never reads
            except OSError:  # the old code ran out of descriptors: later handshakes stall
                return
            socks.append(tls)

        def flood() -> int:
            peak, done = 0, threading.Event()

            def watch() -> None:
                nonlocal peak
                while not done.wait(0.05):
                    peak = max(peak, _descriptors(proc.pid))

            watcher = threading.Thread(target=watch)
            watcher.start()
            with ThreadPoolExecutor(32) as pool:
                list(pool.map(lambda _: half_sent(), range(700)))
            done.set()
            watcher.join()
            return max(peak, _descriptors(proc.pid))

        begun = time.monotonic()
        held = await asyncio.to_thread(flood)
        print(f"flood {time.monotonic() - begun:.1f}s, {len(socks)} clients, peak {held} descriptors")
        # answered while the 700 are still connected (the test holds them all open): on the old code this handshake
        # found no descriptor until asyncio's 30 s TLS shutdown timeout gave shed ones back, so a bound well under
        # that tells the two apart (a hang bound, not a speed one: a loaded machine answers in well under a second)
        assert await asyncio.wait_for(get(port, ca, "/healthz"), TLS_SHUTDOWN_S / 2) == (200, "ok")
        assert len(socks) == 700, f"{700 - len(socks)} of 700 handshakes failed"
        assert held < server.LIMITS.max_connections + 100, f"{held} descriptors of {NOFILE} held during the flood"
    finally:
        for sock in socks:
            sock.close()
        proc.send_signal(signal.SIGTERM)
        await asyncio.to_thread(proc.communicate, None, 30)
