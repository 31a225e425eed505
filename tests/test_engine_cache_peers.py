"""Peer fill of engine caches (docs/engine-caches.md, "Peers"): a node takes the admin's cache for a key from a
real peer server, by the snapshot id its admin gives (the tree's content digest); a peer's file list that digests
to another id, or blob bytes that do not hash to their digest, are refused and the next peer asked; a namespace's
caches are never served to peers nor taken from them."""

from __future__ import annotations

import asyncio
import io
import json
import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from tests.test_engine_cache import cache_files, model_snapshot, tar_of
from weightcache import engine_cache
from weightcache.access import ADMIN, Requester
from weightcache.engine_cache import EngineCacheKey, EngineName
from weightcache.errors import InvalidRequestError, NotCachedError
from weightcache.peers import PeerClient
from weightcache.peers.server import PeerServer
from weightcache.store import Snapshot, Store

TOKEN = b"t" * 32
VLLM = EngineName.parse("vllm-0.32.0-cpu")


async def serve(app: web.Application) -> tuple[web.AppRunner, int]:
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]


def client(port: int) -> PeerClient:
    return PeerClient(f"http://127.0.0.1:{port}", TOKEN, connect_timeout=2, read_timeout=5)


@pytest.fixture
async def holder(tmp_path: Path) -> AsyncIterator[tuple[Store, Snapshot, Snapshot, int]]:
    """Node A: the model, the admin's cache of it and a namespace's, and its real peer server."""
    store = Store(tmp_path / "a")
    model = model_snapshot(store, tmp_path)
    admin = engine_cache.ingest_tar(store, EngineCacheKey.for_model(model, VLLM, ADMIN),
                                    io.BytesIO(tar_of({**cache_files(), "empty": b""})))
    engine_cache.ingest_tar(store, EngineCacheKey.for_model(model, VLLM, Requester("team-a")),
                            io.BytesIO(tar_of({"team-a-only": b"secret"})))
    server = PeerServer(store.layout.blobs, TOKEN)
    port = await server.start("127.0.0.1", 0)
    try:
        yield store, model, admin, port
    finally:
        await server.stop()
        store.close()


async def test_a_node_takes_the_admins_cache_from_a_peer_by_its_id(tmp_path: Path, holder) -> None:
    _, model_a, admin, port = holder
    b = Store(tmp_path / "b")
    model = model_snapshot(b, tmp_path)
    assert model.id == model_a.id, "the same model files: the same snapshot id on every node"
    key = EngineCacheKey.for_model(model, VLLM, ADMIN)
    filled = await asyncio.to_thread(engine_cache.fill_from_peers, b, key, admin.id, [client(port)])
    assert filled.id == admin.id and filled.uri == admin.uri
    assert all((filled.path / f.path).read_bytes() == (admin.path / f.path).read_bytes() for f in admin.files)
    found = engine_cache.lookup(b, model, VLLM, Requester("team-b"))  # the admin's serves every granted namespace
    assert found is not None and found.id == admin.id
    again = await asyncio.to_thread(engine_cache.fill_from_peers, b, key, admin.id, [client(port)])
    assert again.id == admin.id
    b.close()


async def test_a_namespaces_cache_is_never_served_to_peers_nor_taken_from_them(tmp_path: Path, holder) -> None:
    a, model, _, port = holder
    own = engine_cache.lookup(a, model, VLLM, Requester("team-a"))
    assert own is not None and engine_cache.key_of(own).domain == "team-a"  # type: ignore[union-attr]
    assert await asyncio.to_thread(client(port).engine_cache_files, own.id, 1 << 20) is None
    assert await asyncio.to_thread(client(port).engine_cache_files, model.id, 1 << 20) is None, "nor a model's"
    b = Store(tmp_path / "b")
    with pytest.raises(InvalidRequestError, match="only an admin's"):
        engine_cache.fill_from_peers(b, EngineCacheKey.for_model(model_snapshot(b, tmp_path), VLLM,
                                                                 Requester("team-a")), own.id, [client(port)])
    b.close()


async def test_a_lying_peer_is_skipped_and_alone_it_fills_nothing(tmp_path: Path, holder) -> None:
    _, _, admin, port = holder
    listing = {"files": [[f.path, f.size, f.sha256] for f in admin.files]}
    forged = {"files": [[f.path, f.size, f.sha256] for f in admin.files] + [["evil.py", 1, "0" * 64]]}
    served: list[str] = []

    def liar(body: dict[str, object] | str) -> web.Application:
        async def files(request: web.Request) -> web.Response:
            return web.Response(text=body) if isinstance(body, str) else web.json_response(body)

        async def blob(request: web.Request) -> web.Response:  # the right length, other bytes
            served.append(request.match_info["digest"])
            size = next(f.size for f in admin.files if f.sha256 == request.match_info["digest"])
            return web.Response(status=206, body=os.urandom(size),
                                headers={"Content-Range": f"bytes 0-{size - 1}/{size}"})
        app = web.Application()
        app.router.add_get("/v1/engine-caches/{snapshot}", files)
        app.router.add_get("/v1/blobs/sha256/{digest}", blob)
        return app

    runners = []
    try:
        for body in (forged, listing, "[" * 200_000 + "]" * 200_000):  # the last: nesting json.loads cannot take
            runner, lport = await serve(liar(body))
            runners.append((runner, lport))
        b = Store(tmp_path / "b")
        key = EngineCacheKey.for_model(model_snapshot(b, tmp_path), VLLM, ADMIN)
        forger, garbler = client(runners[0][1]), client(runners[1][1])
        with pytest.raises(NotCachedError, match="no peer"):  # its list digests to another id: never believed
            await asyncio.to_thread(engine_cache.fill_from_peers, b, key, admin.id, [forger])
        with pytest.raises(NotCachedError, match="whole and intact"):  # its bytes do not hash to the list's digests
            await asyncio.to_thread(engine_cache.fill_from_peers, b, key, admin.id, [garbler])
        assert served and engine_cache.lookup(b, model_snapshot(b, tmp_path), VLLM, ADMIN) is None
        assert os.listdir(b.layout.partial) == []
        assert not any(b.has_blob(f.sha256) for f in admin.files if f.size)
        nester = client(runners[2][1])
        filled = await asyncio.to_thread(engine_cache.fill_from_peers, b, key, admin.id,
                                         [nester, forger, garbler, client(port)])
        assert filled.id == admin.id and json.loads((filled.path / "modelinfos" / "llama.json").read_bytes()) == {}
        b.close()
    finally:
        for runner, _ in runners:
            await runner.cleanup()
