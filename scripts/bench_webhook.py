#!/usr/bin/env python3
"""Benchmark the admission webhook over HTTPS on loopback, side by side with a minimal plain aiohttp/ssl server.

The baseline is what a user would otherwise write: an aiohttp handler behind the same TLS setup that parses the
AdmissionReview and answers `allowed: true` without looking at the pod, so the ratio is what the mutation, the
policy check, the patch and the metrics cost on top of HTTP + TLS + JSON. Both servers run in their own process
(as in a cluster); the client keeps connections alive like kube-apiserver does.

Per run and server: (1) open loop at --rate reviews/s for --seconds, latency measured from each request's
scheduled send time (a stall is not hidden by sending later); (2) closed loop with --concurrency requests in
flight for --seconds: reviews/s. Runs are interleaved (ours, baseline, ours, ...) with the same idle time before
each; the table shows medians over --runs. The webhook holds --model-caches ModelCaches (default 200, over 50
sources, two of them the pod's models), indexed as the ModelCache watcher's changes index them, and refuses
undeclared models as in a cluster. Targets at 200 reviews/s: p50 < 5 ms, p99 <= 10 ms; the load average is
printed with the figures (on a shared machine it says how much of a miss is the machine).

    .venv/bin/python scripts/bench_webhook.py [--rate 200] [--seconds 5] [--runs 3] [--concurrency 8]
                                              [--model-caches 200]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.fixtures_webhook import admission_review, container, deployment_pod  # noqa: E402
from weightcache.webhook.certs import make_ca, make_serving_cert  # noqa: E402

SNI = "weightcache-webhook.weightcache.svc"

# The webhook with N ModelCaches, as `weightcache webhook` serves it in a cluster (an index built once per change).
OURS = """
import asyncio, sys
from pathlib import Path
from weightcache.policy import CacheIndex
from weightcache.webhook.server import Policy, serve

n = int(sys.argv[3])
sources = ["s3://models/llama-3-8b/", "s3://models/llama-draft/"] + [f"s3://models/m{i}/" for i in range(48)]
index = CacheIndex({"metadata": {"name": f"mc{i}"}, "spec": {"source": sources[i % len(sources)],
                    "allowedNamespaces": [f"team-{i}", "inference"]}} for i in range(n))
policy = Policy(model_caches=lambda: index, allow_undeclared=False)
ready = lambda port: print(f"listening on https://127.0.0.1:{port}/mutate", file=sys.stderr, flush=True)
asyncio.run(serve(policy, cert=Path(sys.argv[1]), key=Path(sys.argv[2]), host="127.0.0.1", port=0, on_ready=ready))
"""

BASELINE = """
import asyncio, json, ssl, sys
from aiohttp import web

async def mutate(request):
    review = json.loads(await request.read())
    return web.json_response({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
                              "response": {"uid": review["request"]["uid"], "allowed": True}})

async def main(cert, key):
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    app = web.Application(client_max_size=8 * 1024 * 1024)
    app.router.add_post("/mutate", mutate)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0, ssl_context=context)
    await site.start()
    print(f"listening on https://127.0.0.1:{runner.addresses[0][1]}/mutate", file=sys.stderr, flush=True)
    await asyncio.Event().wait()

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""


def start(*argv: str) -> tuple[subprocess.Popen[str], int]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBE")}  # off-cluster: no API server here
    proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=env, stderr=subprocess.PIPE, text=True)
    assert proc.stderr is not None
    line = proc.stderr.readline()
    while line and "listening on https://127.0.0.1:" not in line:  # skip log lines before it
        line = proc.stderr.readline()
    if "127.0.0.1:" not in line:
        proc.kill()
        raise SystemExit(f"server did not start: {line}{proc.stderr.read()}")
    return proc, int(line.split("127.0.0.1:")[1].split("/")[0])


def bodies(n: int) -> list[bytes]:
    """Realistic reviews: a Deployment's pod with two containers, an init container and two models."""
    pod = deployment_pod(
        {"weightcache.io/models": "llama=s3://models/llama-3-8b/,draft=s3://models/llama-draft/@v2"},
        containers=[container("server"), container("metrics", image="prom/exporter")],
        init_containers=[container("warmup", image="busybox")],
    )
    return [json.dumps(admission_review(pod)).encode() for _ in range(n)]


async def post(session: aiohttp.ClientSession, url: str, body: bytes, context: ssl.SSLContext) -> None:
    async with session.post(
        url, data=body, ssl=context, server_hostname=SNI, headers={"Content-Type": "application/json"}
    ) as resp:
        answer = await resp.read()
        if resp.status != 200 or b'"allowed":true' not in answer.replace(b" ", b""):
            raise RuntimeError(f"unexpected answer {resp.status}: {answer[:200]!r}")


async def open_loop(url: str, context: ssl.SSLContext, rate: float, seconds: float) -> list[float]:
    """Latencies (s) of rate*seconds reviews sent on a fixed schedule, measured from the scheduled time."""
    payloads = bodies(int(rate * seconds))
    latencies: list[float] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=64)) as session:
        await post(session, url, payloads[0], context)  # connect and handshake outside the measurement

        async def one(at: float, body: bytes) -> None:
            await asyncio.sleep(max(0.0, at - time.perf_counter()))
            await post(session, url, body, context)
            latencies.append(time.perf_counter() - at)

        t0 = time.perf_counter() + 0.05
        await asyncio.gather(*(one(t0 + i / rate, b) for i, b in enumerate(payloads)))
    return latencies


async def closed_loop(url: str, context: ssl.SSLContext, concurrency: int, seconds: float) -> float:
    """Reviews per second with `concurrency` requests always in flight."""
    payload = bodies(1)[0]
    done = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=concurrency)) as session:
        await post(session, url, payload, context)
        deadline = time.perf_counter() + seconds

        async def worker() -> None:
            nonlocal done
            while time.perf_counter() < deadline:
                await post(session, url, payload, context)
                done += 1

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done / (time.perf_counter() - started)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=200.0)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--idle", type=float, default=1.0, help="seconds of idle before each measurement")
    parser.add_argument("--model-caches", type=int, default=200, help="ModelCaches the webhook holds")
    opts = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        ca = make_ca()
        serving = make_serving_cert(ca, [SNI])
        cert, key = Path(tmp, "tls.crt"), Path(tmp, "tls.key")
        cert.write_bytes(serving.cert_pem)
        key.write_bytes(serving.key_pem)
        context = ssl.create_default_context(cadata=ca.cert_pem.decode())
        servers = {
            "weightcache": start("-c", OURS, str(cert), str(key), str(opts.model_caches)),
            "aiohttp echo": start("-c", BASELINE, str(cert), str(key)),
        }
        results: dict[str, dict[str, list[float]]] = {
            name: {"p50": [], "p99": [], "max": [], "rps": []} for name in servers
        }
        try:
            for run in range(opts.runs):
                for name, (_, port) in servers.items():
                    url = f"https://127.0.0.1:{port}/mutate?timeout=10s"
                    time.sleep(opts.idle)
                    lat = asyncio.run(open_loop(url, context, opts.rate, opts.seconds))
                    time.sleep(opts.idle)
                    rps = asyncio.run(closed_loop(url, context, opts.concurrency, opts.seconds))
                    r = results[name]
                    r["p50"].append(percentile(lat, 0.50) * 1e3)
                    r["p99"].append(percentile(lat, 0.99) * 1e3)
                    r["max"].append(max(lat) * 1e3)
                    r["rps"].append(rps)
                    print(
                        f"run {run + 1}/{opts.runs} {name:13s} p50 {r['p50'][-1]:6.2f} ms  p99 {r['p99'][-1]:6.2f} ms"
                        f"  max {r['max'][-1]:6.2f} ms  {rps:7.0f} reviews/s",
                        file=sys.stderr,
                    )
        finally:
            for proc, _ in servers.values():
                proc.terminate()
                proc.communicate(timeout=30)
    report(results, opts)


def report(results: dict[str, dict[str, list[float]]], opts: argparse.Namespace) -> None:
    ours, base = (results[n] for n in ("weightcache", "aiohttp echo"))
    med = statistics.median
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(
        f"\nwebhook over TLS on loopback with {opts.model_caches} ModelCaches, {opts.rate:.0f} reviews/s open loop "
        f"for {opts.seconds:.0f} s, concurrency {opts.concurrency} closed loop; median of {opts.runs} interleaved "
        f"runs; load average {load} on {os.cpu_count()} CPUs"
    )
    print(f"{'metric':28s} {'weightcache':>12s} {'aiohttp echo':>13s} {'ratio':>7s}")
    rows = [
        ("p50 latency (ms)", "p50"),
        ("p99 latency (ms)", "p99"),
        ("max latency (ms)", "max"),
        ("throughput (reviews/s)", "rps"),
    ]
    for label, key in rows:
        a, b = med(ours[key]), med(base[key])
        print(f"{label:28s} {a:12.2f} {b:13.2f} {a / b:7.2f}x")
    p50, p99 = med(ours["p50"]), med(ours["p99"])
    verdict = "met" if p50 < 5 and p99 <= 10 else "MISSED"
    print(f"targets at {opts.rate:.0f}/s: p50 < 5 ms ({p50:.2f}), p99 <= 10 ms ({p99:.2f}): {verdict}")


if __name__ == "__main__":
    main()
