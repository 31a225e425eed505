"""The fetch queue: one fetch per model whoever asks, `parallel` at a time, waiters cost no thread, a queued fetch
says what it waits behind and is dropped when nobody wants it any more. A real Fetcher, real S3 (moto) behind
the fault proxy, which holds downloads open."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import start_daemon
from tests.fixtures_s3 import S3
from tests.grants import granted
from tests.sample import make_model
from weightcache.access import Grant
from weightcache.fetch import FetchCancelledError, Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.store import Snapshot, Store
from weightcache.uri import parse_ref


@dataclass
class Queue:
    queue: FetchQueue
    store: Store
    proxy: FaultProxy

    def weight_gets(self, model: str) -> list[str]:
        return [r.path for r in self.proxy.requests_for("GET", f"/{model}/") if r.path.endswith(".safetensors")]

    async def wait_for_request(self, model: str) -> None:
        while not self.weight_gets(model):
            await asyncio.sleep(0.02)

    async def hold_a(self, seconds: float) -> asyncio.Future[Snapshot]:
        """Start the fetch of model a, its requests held `seconds` by the proxy; return once it is downloading."""
        self.proxy.add("delay", method="GET", path="/a/", seconds=seconds, count=-1)
        running = asyncio.ensure_future(self.queue.ensure(granted("s3://models/a/")))
        await self.wait_for_request("a")
        return running

    async def until(self, depth: tuple[int, int]) -> None:
        """Until the queue holds (running, queued) fetches."""
        while self.queue.depth() != depth:
            await asyncio.sleep(0.01)


@pytest.fixture
def models(s3: S3, tmp_path: Path) -> list[str]:
    make_model(tmp_path / "src", layers=2, hidden=64, vocab=128)
    for name in ("a", "b", "c"):
        s3.upload_dir(tmp_path / "src", "models", f"{name}/")
    return ["a", "b", "c"]


async def make_queue(tmp_path: Path, proxy: FaultProxy, parallel: int) -> Queue:
    store = Store(tmp_path / "store")
    fetcher = Fetcher(store, endpoint_url=proxy.endpoint_url)
    return Queue(FetchQueue(fetcher, parallel=parallel), store, proxy)


@pytest.fixture
async def one_at_a_time(tmp_path: Path, fault_proxy: FaultProxy, models: list[str]) -> AsyncIterator[Queue]:
    q = await make_queue(tmp_path, fault_proxy, parallel=1)
    try:
        yield q
    finally:
        q.queue.close()
        q.store.close()


async def test_fifty_waiters_share_one_fetch_and_hold_no_thread_each(tmp_path: Path, fault_proxy: FaultProxy,
                                                                     models: list[str]) -> None:
    q = await make_queue(tmp_path, fault_proxy, parallel=2)
    try:
        fault_proxy.add("delay", method="GET", path="/a/", seconds=1.0, count=-1)
        before = threading.active_count()
        waiters = [asyncio.ensure_future(q.queue.ensure(granted("s3://models/a/"))) for _ in range(50)]
        await q.wait_for_request("a")
        during = threading.active_count()
        snapshots = await asyncio.gather(*waiters)
        assert len({s.id for s in snapshots}) == 1
        assert len(q.weight_gets("a")) == 2, "one download: each shard fetched once"
        print(f"\nthreads: {before} before, {during} while 50 callers waited on one fetch")
        assert during - before < 30, "waiters must not hold a thread each (50 would)"
    finally:
        q.queue.close()
        q.store.close()


async def test_a_queued_fetch_says_what_it_waits_behind_and_runs_in_its_turn(one_at_a_time: Queue) -> None:
    q = one_at_a_time
    first = await q.hold_a(1.0)
    second = asyncio.ensure_future(q.queue.ensure(granted("s3://models/b/")))
    await q.until((1, 1))  # it looked up the cache and joined the queue
    progress = q.queue.progress(parse_ref("s3://models/b/"))
    assert progress is not None and progress.describe() == "fetching s3://models/b/: queued behind 1 download"
    assert q.weight_gets("b") == [], "parallel=1: the second waits"
    await first
    await second
    assert len(q.weight_gets("b")) == 2 and q.queue.depth() == (0, 0)


async def test_a_queued_fetch_nobody_waits_for_is_dropped_and_a_kept_one_is_not(one_at_a_time: Queue) -> None:
    q = one_at_a_time
    running = await q.hold_a(1.0)
    left = asyncio.ensure_future(q.queue.ensure(granted("s3://models/b/")))  # a client that will hang up
    kept = asyncio.ensure_future(q.queue.ensure(granted("s3://models/c/"), keep=True))  # CSI, reconcile
    await q.until((1, 2))
    left.cancel()
    kept.cancel()
    await asyncio.gather(left, kept, return_exceptions=True)
    assert q.queue.depth() == (1, 1), "b left the queue with its last waiter; c stays"
    assert q.queue.progress(parse_ref("s3://models/b/")) is None
    await running
    await q.until((0, 0))  # c runs in its turn though its caller left
    assert q.weight_gets("b") == [] and len(q.weight_gets("c")) == 2
    assert q.store.lookup(parse_ref("s3://models/c/")) is not None
    assert q.store.lookup(parse_ref("s3://models/b/")) is None


async def test_a_fetch_started_with_nobody_waiting_runs_to_the_end(one_at_a_time: Queue) -> None:
    q = one_at_a_time
    q.queue.start(granted("s3://models/a/"))  # an API ensure without ?wait
    assert q.queue.progress(parse_ref("s3://models/a/")) is not None
    await q.until((0, 0))
    assert q.store.lookup(parse_ref("s3://models/a/")) is not None


async def test_close_fails_queued_fetches(one_at_a_time: Queue) -> None:
    q = one_at_a_time
    running = await q.hold_a(0.5)
    queued = asyncio.ensure_future(q.queue.ensure(granted("s3://models/b/")))
    await q.until((1, 1))
    q.queue.close()
    with pytest.raises(FetchCancelledError, match="stopping"):
        await queued
    await asyncio.gather(running, return_exceptions=True)


async def test_daemon_counts_fetch_failures_by_reason(short_dir: Path, model_copy: Path) -> None:
    d = await start_daemon(short_dir, model_copy)
    try:
        async with d.http() as http, http.put("/v1/models?wait=1",
                                              json={"uri": d.model_uri, "revision": "0123456789ab"}) as r:
            lines = (await r.text()).splitlines()
        assert '"error": "source_not_found"' in lines[-1], lines
        metrics = await asyncio.to_thread(d.client.metrics)
        assert 'weightcache_fetch_failures_total{reason="source_not_found",scheme="file"} 1.0' in metrics
    finally:
        await d.daemon.stop()


async def test_a_running_fetch_whose_last_waiter_leaves_is_stopped(tmp_path: Path, fault_proxy: FaultProxy,
                                                                   models: list[str]) -> None:
    store = Store(tmp_path / "store")

    class OneFetcherPerFetch:  # stoppable one by one: each fetch's Fetcher stops on that job's cancel
        stops_on_cancel = True

        def lookup(self, grant: Grant) -> Snapshot | None:
            return Fetcher(store).lookup(grant)

        def ensure(self, grant: Grant, *, progress: Any = None, on_file: Any = None,
                   cancel: threading.Event | None = None) -> Snapshot:
            return Fetcher(store, endpoint_url=fault_proxy.endpoint_url, cancel=cancel).ensure(grant, progress=progress)

    queue = FetchQueue(OneFetcherPerFetch(), parallel=1)
    try:
        fault_proxy.add("delay", method="GET", path="/a/", seconds=1.0, count=-1)
        waiter = asyncio.ensure_future(queue.ensure(granted("s3://models/a/")))  # a client following the fetch
        while not [r for r in fault_proxy.requests_for("GET", "/a/") if r.path.endswith(".safetensors")]:
            await asyncio.sleep(0.02)
        waiter.cancel()  # it hung up
        await asyncio.gather(waiter, return_exceptions=True)
        while queue.depth() != (0, 0):
            await asyncio.sleep(0.02)
        assert store.lookup(parse_ref("s3://models/a/")) is None, "the fetch stopped instead of publishing"
        # stopped, not finished in the background: no range is asked for once the queue has let the fetch go
        # (files of one request keep no partial; resume of journalled files: test_fetch_progress.py)
        asked = len(fault_proxy.requests_for("GET", "/a/"))
        await asyncio.sleep(1.5)  # longer than the proxy's delay per request
        assert len(fault_proxy.requests_for("GET", "/a/")) == asked
    finally:
        queue.close()
        store.close()


async def test_an_api_client_sees_where_its_fetch_waits(short_dir: Path, model_copy: Path, s3: S3,
                                                       fault_proxy: FaultProxy) -> None:
    for prefix in ("first/", "second/"):
        s3.upload_dir(model_copy, "models", prefix)
    fault_proxy.add("delay", seconds=1.0, method="GET", path="/first/", count=-1)
    d = await start_daemon(short_dir, model_copy, config={
        "parallelModels": 1, "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}})
    try:
        async with d.http() as http:
            async with http.put("/v1/models", json={"uri": "s3://models/first/"}) as r:
                assert r.status == 202
                assert (await r.json())["progress"]["phase"] in ("queued", "listing"), "in the queue before the 202"
            async with http.put("/v1/models?wait=1", json={"uri": "s3://models/second/"}) as r:
                lines = [json.loads(line) async for line in r.content]
        texts = [line["progress"]["text"] for line in lines if "progress" in line]
        last = lines[-1]
        assert "fetching s3://models/second/: queued behind 1 download" in texts, texts
        assert "snapshot" in last, "then it ran in its turn"
    finally:
        await d.daemon.stop()


async def test_raising_parallel_starts_a_queued_fetch_at_once(one_at_a_time: Queue) -> None:
    q = one_at_a_time
    running = await q.hold_a(1.0)
    queued = asyncio.ensure_future(q.queue.ensure(granted("s3://models/b/")))
    await q.until((1, 1))
    q.queue.set_parallel(2)  # parallelModels raised in the live config
    assert q.queue.depth() == (2, 0)
    await asyncio.gather(running, queued)


async def test_a_request_after_close_hears_the_daemon_stops(tmp_path: Path, fault_proxy: FaultProxy,
                                                            models: list[str]) -> None:
    """A CSI or API call racing shutdown: a clear FetchCancelledError, not the pool's 'cannot schedule' error."""
    q = await make_queue(tmp_path, fault_proxy, parallel=1)
    q.queue.close()
    try:
        for call in (q.queue.ensure(granted("s3://models/a/")), q.queue.lookup(granted("s3://models/a/"))):
            with pytest.raises(FetchCancelledError, match="the daemon is stopping"):
                await call
        with pytest.raises(FetchCancelledError, match="the daemon is stopping"):
            q.queue.start(granted("s3://models/b/"))  # reconcile's fire-and-forget fetch
        assert q.weight_gets("a") == [] and q.queue.depth() == (0, 0)
    finally:
        q.store.close()


def test_a_progress_has_one_wire_form_both_ways() -> None:
    """What the engine reports is what the API sends, the client hands on and the CLI prints: one encoding
    (Progress.to_wire, redacted), one decoding (Progress.from_wire), the value back unchanged."""
    from weightcache.progress import Progress

    p = Progress("s3://models/m/", "failed", 5, 10, 1, 2, 2.5, 2.0, "GET http://u:hunter2@minio/x failed", kept=True)
    wire = p.to_wire()
    assert json.loads(json.dumps(wire)) == wire
    assert "hunter2" not in json.dumps(wire) and wire["kept"] is True
    assert wire["text"] == p.describe() == "fetching s3://models/m/: 50% (5 B of 10 B), failed"
    back = Progress.from_wire(json.loads(json.dumps(wire)))
    assert back == Progress("s3://models/m/", "failed", 5, 10, 1, 2, 2.5, 2.0, wire["message"], kept=True)
    assert Progress.from_wire({**Progress.waiting("s3://m/x/").to_wire(), "unknown": 1}) == Progress.waiting("s3://m/x/")
    with pytest.raises(TypeError):
        Progress.from_wire([])  # type: ignore[arg-type]


async def test_a_streamed_progress_line_is_the_wire_form_the_cli_reads(short_dir: Path, model_copy: Path,
                                                                      s3: S3) -> None:
    from weightcache.progress import Progress

    s3.upload_dir(model_copy, "models", "wire/")
    d = await start_daemon(short_dir, model_copy, config={"endpoints": {"s3": {"endpointUrl": s3.endpoint_url}}})
    try:
        async with d.http() as http, http.put("/v1/models?wait=1", json={"uri": "s3://models/wire/"}) as r:
            lines = [json.loads(line) async for line in r.content]
        progress = [line["progress"] for line in lines if "progress" in line]
        assert progress and "snapshot" in lines[-1]
        for wire in progress:
            assert set(wire) == set(Progress.waiting("x").to_wire()), wire
            assert Progress.from_wire(wire).to_wire() == wire  # decoding loses nothing the wire carries
    finally:
        await d.daemon.stop()
