"""The node's fetch queue: one in-flight fetch per model, a bounded number at once, awaited without threads.

`FetchQueue.ensure(grant)` is how the API (and the CLI through it), CSI and the reconcile loop get a model:
  - a cache hit is a lookup on the queue's own small pool, so it never waits behind a download;
  - a miss joins the model's job (one per model key + revision) or queues a new one; jobs run `parallel` at a
    time on the queue's own executor, the rest wait in FIFO order and say so ("queued behind 2 downloads");
  - every caller awaits the job's future: no thread per waiter, no polling;
  - when the last waiter leaves (a client hung up) and nobody asked to keep the job (`keep=True`: reconcile,
    CSI, fire-and-forget API ensures), a queued job is dropped and a running one is asked to stop, where the
    engine says it stops on its `cancel` event (`Engine.stops_on_cancel`; finished chunks stay for a resume).
Progress callbacks are called on the engine's thread with the engine's own Progress values (passed on as they
are: weightcache/progress.py has the one wire form).
Every caller brings a Grant (weightcache/access.py): the queue takes no bare reference. Callers granted the same
files share one job; the engine runs under the first caller's grant.
A caller may also subscribe to the files of its job as each becomes durable (`on_file`, a streaming CSI volume):
one job's hand-overs fan out to every subscriber, and one that joins late first hears those already made. A job
queued or started with a subscriber runs the engine with `on_file`; one started without it hands nothing over
until it ends (its subscribers then take the published snapshot's files).
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Protocol

from weightcache.access import Grant, require_grant
from weightcache.fetch import DurableFile, FetchCancelledError
from weightcache.progress import Progress
from weightcache.signatures import SignaturePolicy
from weightcache.store import Snapshot
from weightcache.uri import ModelRef

log = logging.getLogger(__name__)

ProgressCallback = Callable[[Progress], None]
FileCallback = Callable[[DurableFile], None]  # called on the engine's thread: return quickly
STOPPING = "the daemon is stopping"
MAX_FETCH_THREADS = 64  # a ceiling only: `parallel` bounds the running jobs, threads are made on demand


JobKey = tuple[str, str | None, tuple[SignaturePolicy, ...]]


def job_key(grant: Grant) -> JobKey:
    """What makes two requests the same fetch: the model (uri and filters), the revision asked for, and the
    signatures required (a caller that requires one never joins a fetch that checks none: its files would be
    handed over before model.sig is checked; the engine's model lock runs the two one after the other, and the
    second is a cache hit the engine checks)."""
    return grant.ref.key, grant.ref.revision, grant.signatures


class Engine(Protocol):
    """What the queue runs fetches on: fetch.Fetcher (or, in tests, a Fetcher per fetch, stoppable one by one)."""

    #: `ensure` stops when its `cancel` is set; else a running job that every caller left runs on to its end
    #: and a new caller joins it (a Fetcher stops all its fetches at once: its own `cancel`, `close()`)
    stops_on_cancel: bool

    def lookup(self, grant: Grant) -> Snapshot | None:
        """The cached snapshot of the granted files, or None; quick (a store lookup)."""
        ...

    def ensure(self, grant: Grant, *, progress: ProgressCallback | None = None, on_file: FileCallback | None = None,
               cancel: threading.Event | None = None) -> Snapshot:
        """The snapshot, fetched if need be (blocking, on a queue thread); `on_file` hears of each file once
        durable, `cancel` asks it to stop (where `stops_on_cancel`)."""
        ...


@dataclass(eq=False)
class _Job:
    grant: Grant
    future: asyncio.Future[Snapshot]
    cancel: threading.Event = field(default_factory=threading.Event)
    listeners: list[ProgressCallback] = field(default_factory=list)
    latest: Progress | None = None  # set on the engine's thread
    waiters: int = 0
    keep: bool = False
    running: bool = False
    streaming: bool = False  # a subscriber wanted files as they are durable before the engine started
    subscribers: list[FileCallback] = field(default_factory=list)
    handed: dict[str, DurableFile] = field(default_factory=dict)  # path -> its latest hand-over, for late joiners
    lock: threading.Lock = field(default_factory=threading.Lock)  # subscribers and handed: engine and loop threads

    @property
    def ref(self) -> ModelRef:
        return self.grant.ref

    def subscribe(self, on_file: FileCallback) -> None:
        """Add a subscriber and replay what was handed over so far (a file may then arrive twice: once replayed,
        once live; subscribers take a repeat as a no-op)."""
        with self.lock:
            self.subscribers.append(on_file)
            replay = list(self.handed.values())
        for durable in replay:
            self._tell(on_file, durable)

    def unsubscribe(self, on_file: FileCallback) -> None:
        with self.lock:
            self.subscribers.remove(on_file)

    def hand_over(self, durable: DurableFile) -> None:
        """The engine's on_file (its thread): remember the file, pass it to every subscriber."""
        with self.lock:
            self.handed[durable.entry.path] = durable
            subscribers = list(self.subscribers)
        for on_file in subscribers:
            self._tell(on_file, durable)

    def _tell(self, on_file: FileCallback, durable: DurableFile) -> None:
        try:
            on_file(durable)
        except Exception:  # one subscriber's failure must not fail the download or the others
            log.exception("file subscriber for %s failed on %s", self.ref, durable.entry.path)

    def report(self, progress: Progress) -> None:
        """The engine's progress callback (its thread): remember it, pass it on."""
        self.latest = progress
        for listener in list(self.listeners):
            try:
                listener(progress)
            except Exception:  # a listener's failure must not fail the download
                log.exception("progress listener for %s failed", self.ref)


class FetchQueue:
    """Call every method on the event loop's thread; `close()` from anywhere."""

    def __init__(self, engine: Engine, *, parallel: int = 2) -> None:
        self._engine = engine
        self.parallel = max(1, parallel)
        self._jobs: dict[JobKey, _Job] = {}
        self._queued: collections.deque[_Job] = collections.deque()
        self._running: set[_Job] = set()
        self._fetch_pool = ThreadPoolExecutor(MAX_FETCH_THREADS, thread_name_prefix="wc-fetches")
        self._lookup_pool = ThreadPoolExecutor(2, thread_name_prefix="wc-lookup")
        self._closed = False

    # -- callers ------------------------------------------------------------------------------------------------
    async def lookup(self, grant: Grant) -> Snapshot | None:
        """The cached snapshot, or None; on the queue's lookup pool (never behind a download)."""
        self._refuse_if_closed(grant.ref)
        return await asyncio.get_running_loop().run_in_executor(self._lookup_pool, self._engine.lookup, grant)

    async def ensure(self, grant: Grant, *, progress: ProgressCallback | None = None,
                     keep: bool = False) -> Snapshot:
        """The snapshot of the granted files: at once when cached, else when its one fetch ends. `keep`: the
        fetch goes on when this caller leaves (it is wanted beyond this call)."""
        cached = await self.lookup(grant)
        if cached is not None:
            return cached
        return await self.fetch(grant, progress=progress, keep=keep)

    async def fetch(self, grant: Grant, *, progress: ProgressCallback | None = None, keep: bool = False,
                    on_file: FileCallback | None = None) -> Snapshot:
        """`ensure` for a caller that has just looked the model up and missed: join its one fetch (the engine
        checks the store again under the model's lock, so nothing is fetched twice). `on_file`: told of each file
        once it is verified and durable, while this call waits (see the module's docstring)."""
        job = self._join(grant, keep=keep, streaming=on_file is not None)
        job.waiters += 1
        if progress is not None:
            job.listeners.append(progress)
        if on_file is not None:
            job.subscribe(on_file)
        try:
            return await asyncio.shield(job.future)
        finally:
            job.waiters -= 1
            if progress is not None:
                job.listeners.remove(progress)
            if on_file is not None:
                job.unsubscribe(on_file)
            if job.waiters == 0 and not job.keep and not job.future.done():
                self._abandon(job)

    def start(self, grant: Grant) -> None:
        """Queue a fetch nobody waits for (it is kept until it ends); a no-op when one is in flight."""
        self._join(grant, keep=True)

    def progress(self, ref: ModelRef) -> Progress | None:
        """Where the fetch of `ref` is: its engine's last report, or its place in the queue; None when idle."""
        job = self._job_of(ref)
        if job is None:
            return None
        if job.running:
            return job.latest or Progress.waiting(ref.uri, "listing")
        ahead = self._queued.index(job) + len(self._running) if job in self._queued else 0
        return Progress.waiting(ref.uri, message=f"behind {ahead} download{'s' if ahead != 1 else ''}")

    def _job_of(self, ref: ModelRef) -> _Job | None:
        """The job fetching `ref` (of any signature requirement: there is one, or one after the other)."""
        return next((job for (key, revision, _), job in self._jobs.items()
                     if (key, revision) == (ref.key, ref.revision)), None)

    def kept(self, ref: ModelRef) -> bool:
        """Whether the fetch of `ref` goes on when one of its waiters leaves (kept, or another waiter): what a
        client hears before its Ctrl-C, so it can say whether the download stops."""
        job = self._job_of(ref)
        return job is not None and (job.keep or job.waiters > 1)

    def set_parallel(self, parallel: int) -> None:
        """A new bound on running fetches (live config): more start at once; fewer let running ones finish."""
        self.parallel = max(1, parallel)
        self._pump()

    @property
    def closing(self) -> bool:
        """Whether `close` was called (the daemon stops): a cancelled fetch is then no failure of the model."""
        return self._closed

    def depth(self) -> tuple[int, int]:
        """(running, queued) jobs."""
        return len(self._running), len(self._queued)

    def close(self) -> None:
        """Stop: every job's callers hear it at once; running engines are asked to stop (they park their partial
        files, and the next start resumes them)."""
        self._closed = True
        for job in list(self._queued):
            self._drop(job, STOPPING)
        for job in self._running:
            job.cancel.set()
            if not job.future.done():
                job.future.set_exception(FetchCancelledError(f"{STOPPING} before the fetch of {job.ref} finished; "
                                                             "run the command again: the download resumes where "
                                                             "it stopped"))
                job.future.exception()  # retrieved, whether or not a caller is left to read it
        self._fetch_pool.shutdown(wait=False, cancel_futures=True)
        self._lookup_pool.shutdown(wait=False, cancel_futures=True)

    # -- the queue ----------------------------------------------------------------------------------------------
    def _refuse_if_closed(self, ref: ModelRef) -> None:
        """A request racing the daemon's shutdown hears that it stops (not a pool's 'cannot schedule' error)."""
        if self._closed:
            raise FetchCancelledError(f"{STOPPING}: {ref} was not fetched; run the command again once it is up")

    def _join(self, grant: Grant, *, keep: bool, streaming: bool = False) -> _Job:
        self._refuse_if_closed(require_grant(grant).ref)
        key = job_key(grant)
        job = self._jobs.get(key)
        if job is None:
            job = self._jobs[key] = _Job(grant, asyncio.get_running_loop().create_future(), streaming=streaming)
            self._queued.append(job)
            self._pump()
        job.keep = job.keep or keep
        job.streaming = job.streaming or streaming  # read when the engine starts: a queued job still streams
        return job

    def _pump(self) -> None:
        loop = asyncio.get_running_loop()
        while self._queued and len(self._running) < self.parallel:
            job = self._queued.popleft()
            job.running = True
            self._running.add(job)
            done = self._fetch_pool.submit(self._run, job)
            done.add_done_callback(functools.partial(self._finish_soon, loop, job))

    def _finish_soon(self, loop: asyncio.AbstractEventLoop, job: _Job, done: Future[Snapshot]) -> None:
        try:
            loop.call_soon_threadsafe(self._finished, job, done)  # from the fetch thread back to the loop
        except RuntimeError:  # the daemon stopped and closed its loop before this engine noticed the cancel
            log.debug("the fetch of %s ended after the daemon stopped", job.ref)

    def _run(self, job: _Job) -> Snapshot:
        if job.cancel.is_set():
            raise FetchCancelledError(f"the fetch of {job.ref} was cancelled before it started")
        return self._engine.ensure(job.grant, progress=job.report, on_file=job.hand_over if job.streaming else None,
                                   cancel=job.cancel)

    def _finished(self, job: _Job, done: Future[Snapshot]) -> None:
        self._running.discard(job)
        if self._jobs.get(job_key(job.grant)) is job:
            del self._jobs[job_key(job.grant)]
        if not job.future.done():
            exc = done.exception() if not done.cancelled() else FetchCancelledError(f"fetch of {job.ref} stopped")
            if exc is None:
                job.future.set_result(done.result())
            else:
                job.future.set_exception(exc)
                if job.waiters == 0:
                    job.future.exception()  # nobody will read it: mark it retrieved; the engine logged it
        self._pump()

    def _abandon(self, job: _Job) -> None:
        """The last waiter left a job nobody keeps: drop it from the queue, or ask the engine to stop."""
        if not job.running:
            self._drop(job, "every caller that wanted it went away")
        elif self._engine.stops_on_cancel:
            log.info("cancelling the fetch of %s: every caller that wanted it went away", job.ref)
            job.cancel.set()
            if self._jobs.get(job_key(job.grant)) is job:  # a new caller starts afresh (resuming its chunks)
                del self._jobs[job_key(job.grant)]

    def _drop(self, job: _Job, why: str) -> None:
        self._queued.remove(job)
        if self._jobs.get(job_key(job.grant)) is job:
            del self._jobs[job_key(job.grant)]
        job.future.set_exception(FetchCancelledError(f"the queued fetch of {job.ref} was dropped: {why}"))
        job.future.exception()  # retrieved: its waiters are gone
        log.info("dropped the queued fetch of %s: %s", job.ref, why)
