"""`weightcache engine-cache put/get/list` against a real daemon on its Unix socket (the CLI in a thread: the daemon
runs in the test's event loop): a directory handed over as a streamed tar, its links refused by name, the key's
other parts never served, `-o json` for scripts, a clear error without a daemon."""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from tests.command import run_cli
from tests.fixtures_daemon import start_daemon
from weightcache.errors import InvalidRequestError, NotCachedError, answer_for

FILES = {"torch_compile_cache/3f2a/rank_0_0/backbone/computation_graph.py": b"def f(x): return x\n",
         "inductor/fxgraph/ab/abcdef": os.urandom(300), "modelinfos/llama.json": b"{}"}


def cache_dir(base: Path, files: dict[str, bytes]) -> Path:
    for rel, data in files.items():
        (base / rel).parent.mkdir(parents=True, exist_ok=True)
        (base / rel).write_bytes(data)
    return base


async def run(capfd: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    return await asyncio.to_thread(run_cli, capfd, "engine-cache", *argv)


async def test_put_get_list_through_the_daemon(short_dir: Path, model_copy: Path,
                                               capfd: pytest.CaptureFixture[str]) -> None:
    running = await start_daemon(short_dir, model_copy, config={"models": [{"source": f"file://{model_copy}/"}]})
    sock, uri = str(running.socket), running.model_uri
    try:
        await asyncio.to_thread(running.client.ensure, uri)
        src = cache_dir(short_dir / "vllm-cache", FILES)
        code, out, err = await run(capfd, "put", "vllm-0.32.0-cpu", str(src), "--model", uri, "--socket", sock,
                                   "-o", "json")
        assert code == 0, err
        put = json.loads(out)
        assert put["domain"] == "_admin" and put["snapshot"]["files"] == len(FILES)

        code, out, err = await run(capfd, "get", "vllm-0.32.0-cpu", "--model", uri, "--namespace", "team-a",
                                   "--socket", sock)
        assert code == 0, err
        path = Path(out.strip())
        assert all((path / rel).read_bytes() == data for rel, data in FILES.items()), "the admin's serves them all"

        code, out, _ = await run(capfd, "list", "--socket", sock, "-o", "json")
        assert code == 0 and [(c["key"], c["domain"], c["snapshot"]["id"]) for c in json.loads(out)] == [
            ("vllm-0.32.0-cpu", "_admin", put["snapshot"]["id"])]
        code, out, _ = await run(capfd, "list", "--socket", sock)
        assert code == 0 and out.split()[:3] == ["ENGINE", "MODEL", "SNAPSHOT"] and "vllm-0.32.0-cpu" in out

        # another key is not served: exit code and message of NotCachedError, naming how to hand one over
        code, _, err = await run(capfd, "get", "vllm-0.32.1-cpu", "--model", uri, "--socket", sock)
        assert code == answer_for(NotCachedError("x")).exit_code and "POST /v1/engine-caches" in err

        # a link in the directory travels as a link, and the daemon refuses it by name; nothing more is published
        (src / "inductor" / "evil").symlink_to("/etc/shadow")
        code, _, err = await run(capfd, "put", "vllm-0.32.0-cpu", str(src), "--model", uri, "--namespace",
                                 "team-a", "--socket", sock)
        assert code == answer_for(InvalidRequestError("f", "m")).exit_code and "is a symlink" in err, err
        code, out, _ = await run(capfd, "list", "--socket", sock, "--namespace", "team-a", "-o", "json")
        assert [c["domain"] for c in json.loads(out)] == ["_admin"]
        code, _, err = await run(capfd, "list", "--socket", sock, "--namespace", "Not_A_Namespace")
        assert code == 2 and "not a namespace name" in err
    finally:
        await running.daemon.stop()


async def test_without_a_daemon_or_arguments_it_says_what_to_do(tmp_path: Path,
                                                                capfd: pytest.CaptureFixture[str]) -> None:
    code, _, err = await run(capfd, "list", "--socket", str(tmp_path / "none.sock"))
    assert code != 0 and "no daemon answers" in err and "weightcache daemon" in err
    code, _, err = await run(capfd, "put", "vllm-0.32.0-cpu", "--model", "s3://m/x/")
    assert code == 2 and "needs the cache directory" in err
    code, _, err = await run(capfd, "get", "vllm-0.32.0-cpu")
    assert code == 2 and "needs NAME and --model" in err


async def test_fill_takes_the_admins_cache_from_a_peer_daemon(short_dir: Path, model_copy: Path,
                                                             capfd: pytest.CaptureFixture[str]) -> None:
    """Two real daemons: a cache put on A, then `engine-cache fill` on B by the id A printed, through B's peers."""
    token = short_dir / "peer-token"
    token.write_text("p" * 32 + "\n")
    model = {"source": f"file://{model_copy}/"}
    (short_dir / "a").mkdir()
    (short_dir / "b").mkdir()
    a = await start_daemon(short_dir / "a", model_copy, config={"models": [model], "peerTokenFile": str(token),
                                                               "peerListen": "127.0.0.1:0"})
    b = None
    try:
        b = await start_daemon(short_dir / "b", model_copy, config={
            "models": [model], "peerTokenFile": str(token), "peers": [f"http://127.0.0.1:{a.daemon.peer_port}"]})
        uri = a.model_uri
        for running in (a, b):
            await asyncio.to_thread(running.client.ensure, uri)
        code, out, err = await run(capfd, "put", "vllm-0.32.0-cpu", str(cache_dir(short_dir / "c", FILES)),
                                   "--model", uri, "--socket", str(a.socket), "-o", "json")
        assert code == 0, err
        snapshot = json.loads(out)["snapshot"]["id"]
        code, _, err = await run(capfd, "fill", "vllm-0.32.0-cpu", "--model", uri, "--socket", str(b.socket))
        assert code == 2 and "needs --snapshot" in err
        code, _, err = await run(capfd, "fill", "vllm-0.32.0-cpu", "--model", uri, "--snapshot", snapshot,
                                 "--namespace", "team-a", "--socket", str(b.socket))
        assert code == 2 and "only the admin's are filled from peers" in err
        code, out, err = await run(capfd, "fill", "vllm-0.32.0-cpu", "--model", uri, "--snapshot", snapshot,
                                   "--socket", str(b.socket), "-o", "json")
        assert code == 0, err
        assert json.loads(out)["snapshot"]["id"] == snapshot
        code, out, _ = await run(capfd, "get", "vllm-0.32.0-cpu", "--model", uri, "--socket", str(b.socket))
        assert code == 0 and (Path(out.strip()) / "modelinfos" / "llama.json").read_bytes() == b"{}"
        code, _, err = await run(capfd, "fill", "vllm-0.32.0-cpu", "--model", uri, "--snapshot", "f" * 40,
                                 "--socket", str(b.socket))
        assert code == answer_for(NotCachedError("x")).exit_code and "no peer holds" in err
    finally:
        if b is not None:
            await b.daemon.stop()
        await a.daemon.stop()
