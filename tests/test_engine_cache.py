"""Engine caches (weightcache/engine_cache.py, docs/engine-caches.md): an engine's compile cache handed over as a
tar, kept as a snapshot keyed by (model snapshot, engine-version-device, trust domain); hostile tars refused with
nothing published; a namespace without a grant refused; a key that differs in any part never served."""

from __future__ import annotations

import io
import os
import shutil
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.fixtures_daemon import RunningDaemon, start_daemon
from weightcache import engine_cache
from weightcache.access import ADMIN, Requester
from weightcache.engine_cache import EngineCacheKey, EngineCacheLimits, EngineName, ingest_dir, ingest_tar, lookup
from weightcache.errors import InvalidReferenceError, InvalidRequestError
from weightcache.store import FileEntry, Snapshot, Store
from weightcache.uri import parse_ref

VLLM = EngineName.parse("vllm-0.32.0-cpu")
TEAM_A, TEAM_B = Requester("team-a"), Requester("team-b")


def cache_files() -> dict[str, bytes]:
    """A vLLM-like cache tree: torch_compile_cache/<hash>/rank_0_0/... and inductor's generated code."""
    return {"torch_compile_cache/3f2a/rank_0_0/backbone/computation_graph.py": b"def f(x): return x\n",
            "torch_compile_cache/3f2a/rank_0_0/backbone/vllm_compile_cache.py": b"{(0, 'x'): 'ab'}\n",
            "inductor/fxgraph/ab/abcdef": os.urandom(500),
            "modelinfos/llama.json": b"{}"}


def tar_of(files: dict[str, bytes], extra: Callable[[tarfile.TarFile], None] | None = None,
           fmt: int = tarfile.PAX_FORMAT) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
        if extra is not None:
            extra(tf)
    return buf.getvalue()


def member(name: str, kind: bytes, **fields: object) -> Callable[[tarfile.TarFile], None]:
    def add(tf: tarfile.TarFile) -> None:
        info = tarfile.TarInfo(name)
        info.type = kind
        for k, v in fields.items():
            if k != "data":
                setattr(info, k, v)
        data = fields.get("data")
        if isinstance(data, bytes):
            info.size = len(data)
        tf.addfile(info, io.BytesIO(data) if isinstance(data, bytes) else None)
    return add


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "root")


def model_snapshot(store: Store, tmp_path: Path, name: str = "m") -> Snapshot:
    """A real model snapshot in the store (one small file)."""
    data = name.encode() * 10
    part = store.partial_path(f"model-{name}")
    part.write_bytes(data)
    import hashlib

    sha = hashlib.sha256(data).hexdigest()
    store.add_blob(part, sha)
    return store.publish(parse_ref(f"file://{tmp_path}/{name}/"), [FileEntry("config.json", len(data), sha)])


def published(store: Store) -> list[str]:
    return [i.snapshot.uri for i in store.list()]


def leftovers(store: Store) -> list[str]:
    return os.listdir(store.layout.partial)


def test_a_tar_becomes_a_read_only_snapshot_served_by_its_key(store: Store, tmp_path: Path) -> None:
    model = model_snapshot(store, tmp_path)
    key = EngineCacheKey.for_model(model, VLLM, TEAM_A)
    files = cache_files()
    snap = ingest_tar(store, key, io.BytesIO(tar_of(files, member("torch_compile_cache/empty", tarfile.DIRTYPE))))
    assert engine_cache.is_engine_cache(snap) and not engine_cache.is_engine_cache(model)
    assert snap.uri == f"weightcache-engine-cache://{model.id}/vllm/0.32.0/cpu/team-a/"
    for rel, data in files.items():
        path = snap.path / rel
        assert path.read_bytes() == data
        assert path.stat().st_mode & 0o777 == 0o444
    assert (snap.path / "torch_compile_cache").stat().st_mode & 0o777 == 0o555
    assert lookup(store, model, VLLM, TEAM_A) == store.get(snap.id)
    assert leftovers(store) == []
    # the same bytes again: the same snapshot (content-addressed), still one
    again = ingest_tar(store, key, io.BytesIO(tar_of(files)))
    assert again.id == snap.id and published(store).count(snap.uri) == 1


def test_the_artifact_scheme_is_no_model_reference() -> None:
    """No model door (CSI `model`, PUT /v1/models, a ModelCache) can name an engine cache: parse_ref refuses it."""
    with pytest.raises(InvalidReferenceError, match="unknown scheme"):
        parse_ref("weightcache-engine-cache://" + "a" * 40 + "/vllm/0.32.0/cpu/team-a/")


HOSTILE: dict[str, tuple[Callable[[], bytes], str]] = {
    "symlink": (lambda: tar_of(cache_files(), member("inductor/evil", tarfile.SYMTYPE, linkname="/etc/shadow")),
                "is a symlink"),
    "hard link": (lambda: tar_of(cache_files(), member("inductor/evil", tarfile.LNKTYPE, linkname="modelinfos/llama"
                                                        ".json")), "is a hard link"),
    "dot-dot": (lambda: tar_of({"../../etc/cron.d/x": b"* * * * * root sh"}), "'..'"),
    "dot-dot inside": (lambda: tar_of({"inductor/../../x": b"x"}), "'..'"),
    "absolute": (lambda: tar_of({"/etc/passwd": b"x"}), "absolute path"),
    "char device": (lambda: tar_of({}, member("dev/null", tarfile.CHRTYPE, devmajor=1, devminor=3)),
                    "character device"),
    "block device": (lambda: tar_of({}, member("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=0)), "block device"),
    "fifo": (lambda: tar_of({}, member("pipe", tarfile.FIFOTYPE)), "FIFO"),
    "huge count": (lambda: tar_of({f"f{i}": b"" for i in range(11)}), "more than 10 entries"),
    "oversize": (lambda: tar_of({"a": b"x" * 600, "b": b"y" * 600}), "past 1000 bytes"),
    "duplicate": (lambda: tar_of(cache_files(), member("modelinfos/llama.json", tarfile.REGTYPE, data=b"[]")),
                  "appears twice"),
    "file under a file": (lambda: tar_of({"a": b"1", "a/b": b"2"}), "which is a file"),
    "huge pax header": (lambda: tar_of({"p" * 70_000: b"x"}), "extended tar header"),
    "truncated": (lambda: tar_of({"a": b"x" * 900})[:700], "truncated"),
    "not a tar": (lambda: b"PK\x03\x04 this is a zip" * 40, "not an uncompressed tar"),
    "gzip": (lambda: __import__("gzip").compress(tar_of({"a": b"x"})), "not an uncompressed tar"),
    "control character": (lambda: tar_of({"a\nb": b"x"}), "control character"),
    "empty": (lambda: tar_of({}), "holds no file"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_tar_is_refused_and_nothing_is_published(store: Store, tmp_path: Path, case: str) -> None:
    model = model_snapshot(store, tmp_path)
    blobs_before = sorted(p.name for p in store.layout.blobs.rglob("*") if p.is_file())
    body, why = HOSTILE[case]
    with pytest.raises(InvalidRequestError, match="engine cache") as caught:
        ingest_tar(store, EngineCacheKey.for_model(model, VLLM, TEAM_A), io.BytesIO(body()),
                   EngineCacheLimits(max_bytes=1000, max_entries=10))
    assert why in str(caught.value)
    assert published(store) == [model.uri]
    assert lookup(store, model, VLLM, TEAM_A) is None
    assert leftovers(store) == []
    assert sorted(p.name for p in store.layout.blobs.rglob("*") if p.is_file()) == blobs_before


def test_a_key_that_differs_in_any_part_is_never_served(store: Store, tmp_path: Path) -> None:
    model, other = model_snapshot(store, tmp_path, "m"), model_snapshot(store, tmp_path, "other")
    ingest_tar(store, EngineCacheKey.for_model(model, VLLM, TEAM_A), io.BytesIO(tar_of(cache_files())))
    assert lookup(store, model, VLLM, TEAM_A) is not None
    for name in ("vllm-0.32.1-cpu", "vllm-0.32.0-cuda", "sglang-0.32.0-cpu"):
        assert lookup(store, model, EngineName.parse(name), TEAM_A) is None, name
    assert lookup(store, other, VLLM, TEAM_A) is None  # another model snapshot
    assert lookup(store, model, VLLM, TEAM_B) is None  # another namespace: compile caches hold code it would run
    assert lookup(store, model, VLLM, ADMIN) is None  # nor the admin's domain
    # a cache the node's admin put serves every namespace (that was granted the model: the caller asks first)
    admin_put = ingest_tar(store, EngineCacheKey.for_model(model, VLLM, ADMIN), io.BytesIO(tar_of({"a": b"admin"})))
    found = lookup(store, model, VLLM, TEAM_B)
    assert found is not None and found.id == admin_put.id
    own = lookup(store, model, VLLM, TEAM_A)  # a namespace's own cache comes first
    assert own is not None and own.id != admin_put.id


@pytest.mark.parametrize("text", ["vllm-0.32.0", "vllm-0.32.0-cpu-x", "VLLM-0.32.0-cpu", "vllm-../x-cpu",
                                  "vllm-0.32.0-c/u", "vllm--cpu", ""])
def test_engine_names_are_checked(text: str) -> None:
    with pytest.raises(InvalidRequestError, match="engine cache"):
        EngineName.parse(text)


def test_a_directory_is_walked_without_following_links(store: Store, tmp_path: Path) -> None:
    model = model_snapshot(store, tmp_path)
    src = tmp_path / "cache"
    for rel, data in cache_files().items():
        (src / rel).parent.mkdir(parents=True, exist_ok=True)
        (src / rel).write_bytes(data)
    snap = ingest_dir(store, EngineCacheKey.for_model(model, VLLM, TEAM_A), src)
    assert sorted(f.path for f in snap.files) == sorted(cache_files())
    (src / "inductor" / "evil").symlink_to("/etc/passwd")
    with pytest.raises(InvalidRequestError, match="is a symlink"):
        ingest_dir(store, EngineCacheKey.for_model(model, VLLM, TEAM_B), src)
    (src / "inductor" / "evil").unlink()
    os.mkfifo(src / "fifo")
    with pytest.raises(InvalidRequestError, match="not a regular file"):
        ingest_dir(store, EngineCacheKey.for_model(model, VLLM, TEAM_B), src)
    (src / "fifo").unlink()
    link = tmp_path / "link"
    link.symlink_to(src)
    with pytest.raises(InvalidRequestError, match="without following a symlink"):
        ingest_dir(store, EngineCacheKey.for_model(model, VLLM, TEAM_B), link)
    assert lookup(store, model, VLLM, TEAM_B) is None and leftovers(store) == []


def test_the_pipe_bounds_the_body() -> None:
    pipe = engine_cache.Pipe(limit=10)
    pipe.feed(b"12345")
    with pytest.raises(InvalidRequestError, match="larger than 10 bytes"):
        pipe.feed(b"678901")
    assert pipe.read(5) == b"12345"
    with pytest.raises(InvalidRequestError):
        pipe.read(1)


# -- through the daemon's API (real daemon on its Unix socket) -------------------------------------------------


async def test_the_api_takes_a_cache_for_a_granted_namespace_only(short_dir: Path, model_copy: Path) -> None:
    undeclared = short_dir / "src" / "undeclared"
    shutil.copytree(model_copy, undeclared)
    running = await start_daemon(short_dir, model_copy, config={"models": [{"source": f"file://{model_copy}/"}]})
    try:
        await _api_checks(running, f"file://{undeclared}/")
    finally:
        await running.daemon.stop()


async def _api_checks(daemon: RunningDaemon, undeclared: str) -> None:
    uri = daemon.model_uri
    body = tar_of(cache_files())
    async with daemon.http() as http:
        # the model must be cached here first: the key is the snapshot this node serves
        async with http.post("/v1/engine-caches/vllm-0.32.0-cpu", params={"uri": undeclared}, data=body) as r:
            assert r.status == 404, await r.text()
        for ref in (uri, undeclared):
            async with http.put("/v1/models?wait=1", json={"uri": ref}) as r:
                assert r.status == 200 and b'"snapshot"' in await r.read()
        # a namespace without a grant for the model (undeclared, off-cluster) is refused; nothing published
        async with http.post("/v1/engine-caches/vllm-0.32.0-cpu", params={"uri": undeclared, "namespace": "team-a"},
                             data=body) as r:
            assert r.status == 403, await r.text()
        async with http.post("/v1/engine-caches/vllm-0.32.0-cpu", params={"uri": uri, "namespace": "team-a"},
                             data=body) as r:
            put = await r.json()
            assert r.status == 201, put
        assert put["domain"] == "team-a" and put["snapshot"]["files"] == len(cache_files())
        async with http.get("/v1/engine-caches/vllm-0.32.0-cpu", params={"uri": uri, "namespace": "team-a"}) as r:
            got = await r.json()
            assert r.status == 200 and got["snapshot"]["id"] == put["snapshot"]["id"]
        assert (Path(got["path"]) / "modelinfos" / "llama.json").read_bytes() == b"{}"
        # any other key: not served (version, device, namespace)
        for name, ns in (("vllm-0.32.1-cpu", "team-a"), ("vllm-0.32.0-cuda", "team-a"), ("vllm-0.32.0-cpu", "team-b")):
            async with http.get(f"/v1/engine-caches/{name}", params={"uri": uri, "namespace": ns}) as r:
                assert r.status == 404, (name, ns, await r.text())
        # a hostile tar through the API: 400 naming it, nothing more published
        before = [m["id"] for m in await (await http.get("/v1/models")).json()]
        evil = tar_of(cache_files(), member("inductor/evil", tarfile.SYMTYPE, linkname="/etc/shadow"))
        async with http.post("/v1/engine-caches/vllm-0.32.0-cpu", params={"uri": uri, "namespace": "team-b"},
                             data=evil) as r:
            answer = await r.json()
            assert r.status == 400 and "is a symlink" in answer["message"], answer
        async with http.post("/v1/engine-caches/vllm--cpu", params={"uri": uri}, data=body) as r:
            assert r.status == 400
        after = [m["id"] for m in await (await http.get("/v1/models")).json()]
        assert after == before


def test_an_engine_cache_is_never_a_dra_device(store: Store, tmp_path: Path) -> None:
    """The node's slice lists models only: an engine cache in the store grants nothing as a device."""
    from weightcache.dra.devices import devices_for, snapshot_of

    model = model_snapshot(store, tmp_path)
    cache = ingest_tar(store, EngineCacheKey.for_model(model, VLLM, TEAM_A), io.BytesIO(tar_of(cache_files())))
    listed = {snapshot_of(str(d["name"])) for d in devices_for([model, cache], slots=1, shared=False)}
    assert listed == {model.id}
