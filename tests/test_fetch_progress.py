"""Progress counts bytes as they arrive, and Ctrl-C stops a download at once, keeping what is journalled."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tests.command import start_weightcache
from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import wait_until
from tests.fixtures_s3 import S3
from tests.grants import admin, granted
from tests.tools import sigint_default
from weightcache.fetch import Fetcher
from weightcache.progress import Progress, drop_progress_files, progress_wanted, want_progress
from weightcache.store import Store
from weightcache.uri import parse_ref

SIZE = 1 << 20


def test_a_slow_origin_shows_progress_before_a_chunk_completes(tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    s3.put("models", "m/w.bin", bytes(SIZE))
    fault_proxy.add("throttle", method="GET", ranged_only=True, count=-1, rate=SIZE // 2)  # about 2 s
    seen: list[Progress] = []
    # one chunk is the whole file: counting per finished chunk would show 0 until the very end
    f = Fetcher(Store(tmp_path / "root"), endpoint_url=fault_proxy.endpoint_url, chunk_size=SIZE, concurrency=1)
    f.ensure(granted("s3://models/m/"), progress=seen.append)
    midway = [p.bytes_done for p in seen if p.phase == "downloading" and 0 < p.bytes_done < SIZE]
    assert midway, [(p.phase, p.bytes_done) for p in seen]
    assert midway == sorted(midway) and all(p.bytes_done <= SIZE for p in seen)
    assert len(seen) < 40, "progress events must stay rate-limited"


def test_ctrl_c_stops_a_download_without_waiting_for_its_ranges_and_resume_asks_only_for_the_rest(
        tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    """Once two chunks are journalled every further range is held by the origin, released only after the command
    ended: it must end on Ctrl-C without them (a load-proof order where a '< 2 s' bound stood), keeping what is
    journalled, and the next run asks only for the rest."""
    size, chunk = 4 << 20, 64 << 10
    body = bytes(range(256)) * (size // 256)
    s3.put("models", "big/w.bin", body)
    throttle = fault_proxy.add("throttle", method="GET", ranged_only=True, count=-1, rate=400_000)  # ~10 s in all
    held = fault_proxy.add("hold", method="GET", ranged_only=True, count=-1)
    root = tmp_path / "root"
    proc = start_weightcache(
        "prefetch", "--no-daemon", "-o", "json", "s3://models/big/", "--root", str(root), "--endpoint-url",
        fault_proxy.endpoint_url, "--chunk-size", str(chunk), "--concurrency", "2",
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=sigint_default)
    try:
        journal = wait_until(lambda: next((j for j in root.glob("partial/*.journal")
                                           if len(j.read_text().splitlines()) >= 3), None),
                             timeout=60, what="the journal to record two chunks", every=0.02)
        throttle.count = throttle.fired  # from here on every ranged GET is held
        # both workers' next ranges held, so each was recorded before the resume's requests are counted: a range
        # sent on a kept connection reached the proxy only once its handler had trickled out the last body
        wait_until(lambda: held.fired >= 2, timeout=30, what="both workers' next ranges at the held origin",
                   every=0.02)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)  # ending here means no held range was waited for
    finally:
        held.release.set()
        proc.kill()
    assert proc.returncode == 130, err
    assert "Traceback" not in err and "resume" in err

    journalled = [tuple(map(int, line.split())) for line in journal.read_text().splitlines()[1:]]
    assert journalled and all(n == chunk for _, n in journalled)
    fault_proxy.faults.remove(throttle)
    fault_proxy.faults.remove(held)
    fault_proxy.clear()
    snap = Fetcher(Store(root), endpoint_url=fault_proxy.endpoint_url, chunk_size=chunk).ensure(admin(
        parse_ref("s3://models/big/")))
    assert (snap.path / "w.bin").read_bytes() == body
    asked = fault_proxy.ranges_for("/models/big/w.bin")
    for a, b in asked:
        assert not any(a < off + n and off <= b for off, n in journalled), f"journalled bytes refetched: {a}-{b}"
    assert sum(b - a + 1 for a, b in asked) == size - sum(n for _, n in journalled)


def test_the_progress_file_is_written_only_for_a_process_that_waits_on_the_fetch(
        tmp_path: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    """The holder of a model's fetch lock writes its progress file only once another process says it waits
    (engine `_acquire`: `want_progress`), at most once a second: a daemon's fetches have no such waiter and
    rewrote it 5 times a second each (issue 39). The waiter still sees the holder's progress."""
    s3.put("models", "m/w.bin", bytes(SIZE))
    fault_proxy.add("throttle", method="GET", ranged_only=True, count=-1, rate=SIZE // 4)  # about 4 s
    store = Store(tmp_path / "root")
    holder = Fetcher(store, endpoint_url=fault_proxy.endpoint_url, chunk_size=SIZE // 4, concurrency=1)
    progress_file = store.partial_path(f"{parse_ref('s3://models/m/').key}.progress")
    seen: list[Progress] = []
    with ThreadPoolExecutor(2) as pool:
        first = pool.submit(holder.ensure, granted("s3://models/m/"), progress=seen.append)
        deadline = time.monotonic() + 30
        while not any(p.phase == "downloading" and p.bytes_done for p in seen):
            assert time.monotonic() < deadline, "the holder never got going"
            time.sleep(0.02)
        time.sleep(1.2)  # more than FILE_EVERY_S of downloading with nobody waiting
        assert not progress_file.exists()
        waited: list[Progress] = []
        waiter = Fetcher(store, endpoint_url=fault_proxy.endpoint_url, chunk_size=SIZE // 4, concurrency=1)
        second = pool.submit(waiter.ensure, granted("s3://models/m/"), progress=waited.append)
        first.result(60)
        second.result(60)
    assert any(p.phase == "downloading" and 0 < p.bytes_done < SIZE for p in waited), waited
    assert not progress_file.exists() and not list(store.partial_path("x").parent.glob("*.wanted"))


def test_a_link_planted_as_the_wanted_marker_is_not_followed(tmp_path: Path) -> None:
    """The marker a waiting process leaves beside the progress file is created without following a link there:
    a link planted to a file elsewhere never creates that file."""
    path = tmp_path / "m0123.progress"
    target = tmp_path / "elsewhere" / "created-through-the-link"
    target.parent.mkdir()
    path.with_name(path.name + ".wanted").symlink_to(target)
    want_progress(path)
    assert not target.exists()
    assert progress_wanted(path)  # a marker is there (the link): the fetch writes its progress, nothing more
    drop_progress_files(path)
    assert not os.path.lexists(path.with_name(path.name + ".wanted"))
    want_progress(path)
    assert progress_wanted(path) and path.with_name(path.name + ".wanted").is_file()
