"""The CLI as a user runs it (subprocesses) next to a real daemon: every store command goes through the daemon
when its socket answers, read-only commands never create a store, id prefixes from 4 characters, hints that read
right, Ctrl-C that stops a direct download within a second and says plainly what the daemon does, --dry-run
and --quiet."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.command import start_weightcache, weightcache
from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import RunningDaemon, eventually, start_daemon
from tests.fixtures_s3 import S3
from tests.sample import make_model
from tests.tools import sigint_default
from weightcache.cli_backends import match
from weightcache.errors import InvalidReferenceError, NotCachedError


def cli_env(*, socket: Path | str = "/nonexistent/wc.sock", root: Path | str | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "WEIGHTCACHE_SOCKET", "WEIGHTCACHE_ROOT")}
    env.update({"KUBECONFIG": "/nonexistent", "WEIGHTCACHE_SOCKET": str(socket)})
    if root is not None:
        env["WEIGHTCACHE_ROOT"] = str(root)
    return env


async def awc(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`weightcache` without blocking the event loop the daemon under test runs on."""
    return await asyncio.to_thread(weightcache, *args, env=env)


@pytest.mark.e2e
async def test_every_store_command_goes_through_the_daemon(daemon: RunningDaemon, short_dir: Path) -> None:
    snap = await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    elsewhere = short_dir / "cli-default-root"  # where the CLI would look without the daemon: must stay untouched
    env = cli_env(socket=daemon.socket, root=elsewhere)
    store = daemon.daemon.node.store  # type: ignore[union-attr]

    r = await awc("ls", "-o", "json", env=env)
    assert r.returncode == 0, r.stderr
    assert [m["id"] for m in json.loads(r.stdout)] == [snap["id"]]

    r = await awc("pin", snap["id"][:4], env=env)  # a 4-character id prefix names it
    assert r.returncode == 0, r.stderr
    assert "pinned" in r.stdout and snap["id"] in [i.snapshot.id for i in store.list() if i.pinned]
    r = await awc("evict", daemon.model_uri, env=env)
    assert r.returncode == 4 and "pinned" in r.stderr  # the daemon's refusal, with its exit code
    r = await awc("unpin", snap["id"][:6], env=env)
    assert r.returncode == 0 and not any(i.pinned for i in store.list())

    r = await awc("verify", env=env)
    assert r.returncode == 0 and f"ok       {daemon.model_uri} {snap['id'][:12]}" in r.stdout
    r = await awc("gc", env=env)
    assert r.returncode == 0 and r.stdout.startswith("freed ")
    r = await awc("evict", snap["id"][:5], env=env)
    assert r.returncode == 0, r.stderr
    assert await asyncio.to_thread(daemon.client.list) == []
    r = await awc("evict", daemon.model_uri, env=env)
    assert r.returncode == 3 and f"nothing cached in the daemon at {daemon.socket}" in r.stderr
    assert not elsewhere.exists()


@pytest.mark.e2e
async def test_evict_through_the_daemon_names_the_holder(daemon: RunningDaemon) -> None:
    snap = await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    await asyncio.to_thread(daemon.client.lease, "job-42", snapshot=snap["id"])
    r = await awc("evict", snap["id"][:8], env=cli_env(socket=daemon.socket))
    assert r.returncode == 4 and "Held by: job-42" in r.stderr


@pytest.mark.e2e
@pytest.mark.parametrize("args", [["ls"], ["ls", "-o", "json"], ["evict", "s3://models/llama/"], ["evict", "abcd1234"],
                                  ["pin", "abcd"], ["verify"], ["gc"], ["status"], ["evict", "--to-size", "1Gi"]])
def test_read_only_commands_never_create_a_store(tmp_path: Path, args: list[str]) -> None:
    root = tmp_path / "var-lib-weightcache"
    r = weightcache(*args, env=cli_env(root=root))
    assert r.returncode in (0, 3), r.stderr
    if r.returncode == 3:
        assert f"nothing cached in the store at {root}" in r.stderr
    assert not root.exists(), f"`weightcache {' '.join(args)}` created {root}"


def test_id_prefixes_need_4_characters_and_ambiguity_is_named() -> None:
    entries = [{"id": "abcd1111" + "0" * 56, "uri": "s3://models/a/"}, {"id": "abcd2222" + "0" * 56,
                                                                       "uri": "s3://models/b/"}]
    assert match(entries, "abcd1", where="here") == [entries[0]]
    with pytest.raises(InvalidReferenceError, match=r"'abcd' matches 2 snapshots: abcd11110000 \(s3://models/a/\), "
                                                   r"abcd22220000 \(s3://models/b/\); give more characters"):
        match(entries, "abcd", where="here")
    with pytest.raises(InvalidReferenceError, match="at least 4 characters"):
        match(entries, "abc", where="here")
    with pytest.raises(NotCachedError, match="nothing cached in here matches 'ffff'"):
        match(entries, "ffff", where="here")
    assert match(entries, "s3://models/b/", where="here") == [entries[1]]


@pytest.mark.e2e
def test_no_such_bucket_hint_names_the_model(s3: S3, tmp_path: Path) -> None:
    r = weightcache("prefetch", "s3://no-such-bucket-here/llama/", "--endpoint-url", s3.endpoint_url,
           "--root", str(tmp_path / "root"), env=cli_env())
    assert r.returncode == 6, r.stderr
    assert "aws s3 ls s3://no-such-bucket-here/llama/`" in r.stderr
    assert "ls listing" not in r.stderr


def _start(args: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    return start_weightcache(*args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=sigint_default)


def _wait_for_download(proc: subprocess.Popen[str], timeout: float = 60.0) -> None:
    """Read JSON progress lines from stderr until the download moved some bytes."""
    assert proc.stderr is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = proc.stderr.readline()
        assert line, f"the command ended before downloading: {proc.wait()}"
        if line.startswith("{") and json.loads(line).get("bytes_done", 0) > 0:
            return
    raise AssertionError("no download progress")


@pytest.mark.e2e
def test_ctrl_c_stops_a_direct_download_without_waiting_for_its_ranges(s3: S3, fault_proxy: FaultProxy,
                                                                       tmp_path: Path) -> None:
    """Ranges get through slowly until the download shows progress, then every ranged GET is held by the origin:
    Ctrl-C must end the command while they are still held (waiting for them, or for the queued ones, would never
    end), and fetch nothing new. The model has ~100 ranges of 64 KiB, so most are still to come at the first
    progress line."""
    make_model(tmp_path / "model", shards=2)
    s3.upload_dir(tmp_path / "model", "models", "tiny/")
    slow = fault_proxy.add("delay", seconds=0.3, method="GET", ranged_only=True, count=-1)
    held = fault_proxy.add("hold", method="GET", ranged_only=True, count=-1)
    root = tmp_path / "root"
    proc = _start(["prefetch", "s3://models/tiny/", "--root", str(root), "--endpoint-url", fault_proxy.endpoint_url,
                   "--chunk-size", "64Ki", "--concurrency", "2"], cli_env())
    try:
        _wait_for_download(proc)
        slow.count = slow.fired  # from here on every ranged GET is held
        assert held.arrived.wait(30), "no range reached the held origin"
        gets_before = len(fault_proxy.requests_for("GET"))
        proc.send_signal(signal.SIGINT)
        # the held ranges are released only in `finally`, so an ending here means nothing held was waited for
        _, err = proc.communicate(timeout=30)
    finally:
        held.release.set()
        proc.kill()
    assert proc.returncode == 130, err
    assert "cancelled the download of s3://models/tiny/" in err and "Traceback" not in err
    assert len(fault_proxy.requests_for("GET")) <= gets_before + 2, "queued ranges were still fetched"
    assert any((root / "partial").iterdir()), "finished chunks must stay for the next run"


@pytest.mark.e2e
async def test_ctrl_c_through_the_daemon_says_what_the_daemon_does(
        short_dir: Path, model_copy: Path, s3: S3, fault_proxy: FaultProxy) -> None:
    s3.upload_dir(model_copy, "models", "tiny/")
    fault_proxy.add("delay", seconds=0.5, method="GET", ranged_only=True, count=-1)
    d = await start_daemon(short_dir, model_copy, config={
        "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}, "concurrency": 1, "chunkSize": "64Ki"})
    env = cli_env(socket=d.socket)
    try:
        alone = await _interrupt_prefetch("s3://models/tiny/", env)
        assert alone.returncode == 130
        assert "cancelled: the daemon stops fetching s3://models/tiny/" in alone.stderr
        assert "interrupted" not in alone.stderr
        fetches = d.daemon.node.fetches  # type: ignore[union-attr]
        await eventually(lambda: fetches.depth() == (0, 0), what="the daemon to stop the fetch")

        async with d.http() as http, http.put("/v1/models", json={"uri": "s3://models/tiny/"}) as r:
            assert r.status == 202  # fire and forget: the daemon keeps this fetch
        kept = await _interrupt_prefetch("s3://models/tiny/", env)
        assert kept.returncode == 130
        assert "the daemon goes on fetching s3://models/tiny/" in kept.stderr
        assert fetches.depth()[0] + fetches.depth()[1] == 1
    finally:
        await d.daemon.stop()


async def _interrupt_prefetch(uri: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    def run() -> subprocess.CompletedProcess[str]:
        proc = _start(["prefetch", uri], env)
        try:
            _wait_for_download(proc)
            proc.send_signal(signal.SIGINT)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()
        return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return await asyncio.to_thread(run)


@pytest.mark.e2e
def test_dry_run_lists_what_would_be_fetched_and_downloads_nothing(s3: S3, model_copy: Path,
                                                                    tmp_path: Path) -> None:
    s3.upload_dir(model_copy, "models", "tiny/")
    root = tmp_path / "root"
    common = ["--endpoint-url", s3.endpoint_url, "--root", str(root)]
    r = weightcache("prefetch", "s3://models/tiny/", "--dry-run", "--include", "*.safetensors", "-o", "json", *common,
           env=cli_env())
    assert r.returncode == 0, r.stderr
    plan: dict[str, Any] = json.loads(r.stdout)
    sizes = {f.name: f.stat().st_size for f in model_copy.glob("*.safetensors")}
    assert {f["path"]: f["size"] for f in plan["files"]} == sizes
    assert plan["bytes"] == sum(sizes.values()) and plan["cached"] == []
    assert not root.exists()

    assert weightcache("prefetch", "s3://models/tiny/", "-q", *common, env=cli_env()).returncode == 0
    r = weightcache("prefetch", "s3://models/tiny/", "--dry-run", *common, env=cli_env())
    assert "config.json" in r.stdout and "cached as snapshot" in r.stdout


@pytest.mark.e2e
def test_quiet_prints_only_the_path(model_copy: Path, tmp_path: Path) -> None:
    r = weightcache("prefetch", f"file://{model_copy}/", "-q", "--root", str(tmp_path / "root"), env=cli_env())
    assert r.returncode == 0, r.stderr
    assert r.stderr == ""
    (path,) = r.stdout.splitlines()
    assert (Path(path) / "config.json").exists()
    r = weightcache("evict", f"file://{model_copy}/", "-q", "--root", str(tmp_path / "root"), env=cli_env())
    assert r.returncode == 0 and r.stdout == "" and r.stderr == ""


@pytest.mark.e2e
async def test_a_hit_through_the_daemon_imports_no_store(daemon: RunningDaemon) -> None:
    """The CLI's side of a cache hit is interpreter start and imports: the store's modules (msgspec, sqlite3:
    0.1-0.3 s) were imported to read a free-space floor only a direct fetch uses, and the pods package (0.02-0.07
    s) for two constants of the webhook command's parser; http.client (with the email package and ssl, 20 ms)
    for the few requests the daemon's client makes, tarfile for engine caches only. No source's library either:
    the daemon fetches. Nor does parsing its flags read weightcache/settings.py's source for their help (14 ms of
    CPU): only --help does. Nor logging (5-9 ms with traceback, linecache and tokenize: nothing on this path logs),
    threading, or the fetch settings themselves (weightcache/settings.py: its flags are declared only where one
    may be given, cli.CommandParser)."""
    await asyncio.to_thread(daemon.client.ensure, daemon.model_uri)
    code = ("import sys; from weightcache.cli import main; rc = main(['prefetch', '-q', sys.argv[1]]); "
            "print(rc, sorted(m for m in ('weightcache.store', 'msgspec', 'sqlite3', 'weightcache.pods', 'botocore', "
            "'http.client', 'email', 'ssl', 'tarfile', 'weightcache.sources', 'weightcache.fetch', 'logging', "
            "'threading', 'weightcache.settings') "
            "if m in sys.modules), [f for f in __import__('linecache').cache if f.endswith('settings.py')])")
    done = await asyncio.to_thread(subprocess.run, [sys.executable, "-c", code, daemon.model_uri], capture_output=True,
                                   text=True, timeout=60, env=cli_env(socket=daemon.socket))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "0 [] []"
