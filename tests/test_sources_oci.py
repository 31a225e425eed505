"""oci:// against a real registry (docker-registry on 127.0.0.1) with artifacts pushed by the real oras SDK:
ModelPack and ORAS artifacts by tag and by digest, indexes, auth (htpasswd Basic from a docker config file, a
Bearer challenge answered by a token server of the test's own), a moved tag, damaged blobs (exit 7, nothing
published), hostile manifests, and the CLI."""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from tests.command import weightcache
from tests.fixtures_daemon import start_daemon
from tests.fixtures_registry import FILEPATH, MODEL_CONFIG, RAW, Registry, docker_config
from tests.grants import granted
from weightcache.errors import HostileKeyError, IntegrityError, SourceAccessDeniedError, SourceError
from weightcache.fetch import Fetcher
from weightcache.sources import open_source
from weightcache.sources.oci import OciSource, _descriptor, plain_http
from weightcache.store import Snapshot, Store
from weightcache.uri import parse_ref

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"


def files(seed: str, big: int = 0) -> dict[str, bytes]:
    """A small model whose bytes are this test's own (blobs are shared by content across repositories)."""
    out = {"config.json": json.dumps({"seed": seed}).encode(), "sub/tokenizer.json": f"tok {seed}".encode()}
    if big:
        out["model.bin"] = hashlib.sha256(seed.encode()).digest() * (big // 32)
    return out


def fetch(root: Path, text: str, **kwargs: Any) -> Snapshot:
    return Fetcher(Store(root), chunk_size=64 << 10, **kwargs).ensure(granted(text))


def tree(snap: Snapshot) -> dict[str, bytes]:
    return {f.path: (snap.path / f.path).read_bytes() for f in snap.files}


def test_a_modelpack_artifact_by_tag_and_by_digest(tmp_path: Path, registry: Registry) -> None:
    want = files("pack", big=300_000)  # model.bin spans several ranged requests
    digest = registry.push("models/tiny:v1", want)
    by_tag = fetch(tmp_path / "root", f"oci://{registry.host}/models/tiny:v1")
    assert tree(by_tag) == want
    by_digest = fetch(tmp_path / "root", f"oci://{registry.host}/models/tiny@{digest}")
    assert tree(by_digest) == want and by_digest.id == by_tag.id
    assert {f.sha256 for f in by_tag.files} == {hashlib.sha256(b).hexdigest() for b in want.values()}


def test_layer_digests_are_claims_even_when_the_manifest_is_pinned_by_digest(registry: Registry) -> None:
    digest = registry.push("models/evidence:v1", files("evidence"))
    by_tag = OciSource(parse_ref(f"oci://{registry.host}/models/evidence:v1"))
    listed = by_tag.list()
    assert all(o.checksum is None for o in listed) and not by_tag.trusted  # a claim: checks bytes only
    assert all(by_tag.claimed_sha256(o) == o.etag for o in listed)
    pinned = OciSource(parse_ref(f"oci://{registry.host}/models/evidence@{digest}"))
    # a pin proves which manifest, not that its layers are the bytes they name: a hostile registry's pinned
    # manifest may name another tenant's blob digest, which must never be linked unread nor asked of peers
    assert all(o.checksum is None for o in pinned.list()) and pinned.trusted
    assert all(pinned.claimed_sha256(o) == o.etag for o in pinned.list())


def test_a_manifest_that_does_not_hash_to_its_pinned_digest_is_an_integrity_failure(
        tmp_path: Path, registry: Registry) -> None:
    digest = registry.push("models/forged:v1", files("forged-a"))
    other = registry.push("models/forged:v2", files("forged-b"))
    registry.blob_file(digest).write_bytes(registry.blob_file(other).read_bytes())  # the registry lies
    with pytest.raises(IntegrityError, match="hashes to"):
        fetch(tmp_path / "root", f"oci://{registry.host}/models/forged@{digest}")


def test_oras_title_and_cnai_filepath_name_files(tmp_path: Path, registry: Registry) -> None:
    registry.push("models/oras:v1", {"weights.bin": b"oras bytes"}, media_type="application/vnd.oci.image.layer.v1.tar",
                  annotation="org.opencontainers.image.title", modelpack=False)
    assert tree(fetch(tmp_path / "a", f"oci://{registry.host}/models/oras:v1")) == {"weights.bin": b"oras bytes"}
    registry.push("models/cnai:v1", {"deep/w.bin": b"cnai bytes"},
                  media_type="application/vnd.cnai.model.weight.v1.raw", annotation="org.cnai.model.filepath")
    assert tree(fetch(tmp_path / "b", f"oci://{registry.host}/models/cnai:v1")) == {"deep/w.bin": b"cnai bytes"}


def test_a_moved_tag_is_fetched_again_and_the_old_snapshot_stays(tmp_path: Path, registry: Registry) -> None:
    ref = f"oci://{registry.host}/models/moving:v1"
    registry.push("models/moving:v1", files("old"))
    old = fetch(tmp_path / "root", ref)
    fetcher = Fetcher(Store(tmp_path / "root"), chunk_size=64 << 10)
    assert fetcher.ensure(granted(ref)).id == old.id and fetcher.stats["hits"] == 1  # the tag names it still
    registry.push("models/moving:v1", files("new"))
    assert fetcher.lookup(granted(ref)) is None  # the daemon's fast path (FetchQueue) misses too
    new = fetcher.ensure(granted(ref))
    assert tree(new) == files("new") and new.id != old.id and fetcher.stats["misses"] == 1
    assert fetcher.ensure(granted(ref)).id == new.id  # and is a hit from then on
    store = Store(tmp_path / "root")
    assert tree(store.get(old.id)) == files("old")  # the old snapshot stays until evicted
    assert store.lookup(parse_ref(ref)) is not None and store.lookup(parse_ref(ref)).id == new.id  # type: ignore[union-attr]


async def test_the_daemon_serves_what_a_moved_tag_names_now(short_dir: Path, model_copy: Path,
                                                             registry: Registry) -> None:
    """Hardening IV: the daemon's fast path (`MeteredFetcher.lookup`, what the fetch queue asks on every API
    ensure, CSI publish and reconcile) was a plain store lookup: a moved tag was served stale. Through the
    daemon's socket: push v1, ensure, move the tag, ensure again -> the new files, the old snapshot kept."""
    ref = f"oci://{registry.host}/models/moving-daemon:v1"
    registry.push("models/moving-daemon:v1", files("before"))
    d = await start_daemon(short_dir, model_copy)
    try:
        async def ensure() -> dict[str, Any]:
            async with d.http() as http, http.put("/v1/models?wait=1", json={"uri": ref}) as r:
                assert r.status == 200, await r.text()
                lines = [json.loads(line) async for line in r.content if line.strip()]
            snapshot: dict[str, Any] = lines[-1]["snapshot"]
            return snapshot

        old = await ensure()
        assert (await ensure())["id"] == old["id"]  # the tag names it still: a hit
        registry.push("models/moving-daemon:v1", files("after"))
        new = await ensure()
        assert new["id"] != old["id"], "the daemon served the snapshot the tag no longer names"
        snap = Store(d.root).get(new["id"])
        assert tree(snap) == files("after")
        assert tree(Store(d.root).get(old["id"])) == files("before")  # kept until evicted
    finally:
        await d.daemon.stop()


def test_a_tag_served_from_cache_when_the_registry_cannot_say(tmp_path: Path) -> None:
    reg = Registry.start(tmp_path / "gone")
    ref = f"oci://{reg.host}/models/offline:v1"
    reg.push("models/offline:v1", files("offline"))
    old = fetch(tmp_path / "root", ref)
    reg.stop()  # the registry is down: the node keeps serving what it holds
    fetcher = Fetcher(Store(tmp_path / "root"), connect_timeout=1)
    assert fetcher.ensure(granted(ref)).id == old.id
    pinned = f"oci://{reg.host}/models/offline@sha256:{'0' * 64}"  # a digest never asks the registry
    assert OciSource(parse_ref(pinned)).still_names(old)


def _index(registry: Registry, repo: str, entries: list[tuple[str, dict[str, str] | None]]) -> dict[str, Any]:
    manifests = []
    for tag, platform in entries:
        body = registry._call("GET", f"/v2/{repo}/manifests/{tag}", None, {"Accept": OCI_MANIFEST}).read()
        entry: dict[str, Any] = {"mediaType": OCI_MANIFEST, "size": len(body),
                                 "digest": "sha256:" + hashlib.sha256(body).hexdigest()}
        if platform:
            entry["platform"] = platform
        manifests.append(entry)
    return {"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": manifests}


def test_an_index_gives_linux_amd64_or_its_only_manifest(tmp_path: Path, registry: Registry) -> None:
    registry.push("models/multi:arm", files("arm"))
    registry.push("models/multi:amd", files("amd"))
    index = _index(registry, "models/multi", [("arm", {"os": "linux", "architecture": "arm64"}),
                                             ("amd", {"os": "linux", "architecture": "amd64"})])
    digest = registry.put_manifest("models/multi", "list", index, OCI_INDEX)
    assert tree(fetch(tmp_path / "a", f"oci://{registry.host}/models/multi:list")) == files("amd")
    pinned = OciSource(parse_ref(f"oci://{registry.host}/models/multi@{digest}"))
    assert pinned.list() and pinned.trusted  # index pinned and hashed, child hashed to the index's digest
    registry.put_manifest("models/multi", "one", _index(registry, "models/multi", [("arm", None)]), OCI_INDEX)
    assert tree(fetch(tmp_path / "b", f"oci://{registry.host}/models/multi:one")) == files("arm")
    two = _index(registry, "models/multi", [("arm", {"os": "linux", "architecture": "arm64"}),
                                            ("amd", {"os": "linux", "architecture": "s390x"})])
    registry.put_manifest("models/multi", "two", two, OCI_INDEX)
    with pytest.raises(SourceError, match="none for linux/amd64"):
        OciSource(parse_ref(f"oci://{registry.host}/models/multi:two")).list()


@pytest.mark.parametrize("damage", ["truncated", "bit-flipped"])
@pytest.mark.parametrize("pin", ["tag", "digest"])
def test_a_damaged_blob_is_an_integrity_failure_and_nothing_is_published(
        tmp_path: Path, registry: Registry, damage: str, pin: str) -> None:
    repo = f"models/damaged-{damage}-{pin}"
    want = files(repo, big=200_000)
    digest = registry.push(f"{repo}:v1", want)
    layer = "sha256:" + hashlib.sha256(want["model.bin"]).hexdigest()
    blob = registry.blob_file(layer)
    data = bytearray(blob.read_bytes())
    if damage == "truncated":
        del data[150_000:]
    else:
        data[123_456] ^= 0x01
    blob.write_bytes(bytes(data))
    text = f"oci://{registry.host}/{repo}" + (":v1" if pin == "tag" else f"@{digest}")
    with pytest.raises(IntegrityError):
        fetch(tmp_path / "root", text)
    assert Store(tmp_path / "root").lookup(parse_ref(text)) is None
    assert Store(tmp_path / "root").list() == []


def _hostile(registry: Registry, repo: str, layers: list[dict[str, Any]]) -> OciSource:
    config = registry.put_blob(repo, b"{}")
    registry.put_manifest(repo, "v1", {"schemaVersion": 2, "mediaType": OCI_MANIFEST,
                                       "config": {"mediaType": MODEL_CONFIG, "digest": config, "size": 2},
                                       "layers": layers}, OCI_MANIFEST)
    return OciSource(parse_ref(f"oci://{registry.host}/{repo}:v1"))


def _layer(digest: str, name: str, media_type: str = RAW, size: int = 5) -> dict[str, Any]:
    return {"mediaType": media_type, "digest": digest, "size": size, "annotations": {FILEPATH: name}}


@pytest.mark.parametrize(("case", "error", "match"), [
    ("traversal", HostileKeyError, "'..'"),
    ("absolute", HostileKeyError, "/etc/passwd"),
    ("unknown media type", SourceError, "unknown media type"),
    ("tar+zstd layer", SourceError, "tar\\+zstd, which this build does not unpack"),
    ("the store's own name", HostileKeyError, "the store's own directory"),
    ("twice", HostileKeyError, "named by two layers"),
    ("no name", SourceError, "names no file"),
    ("huge layer count", HostileKeyError, "layers, more than 10000"),
])
def test_a_hostile_manifest_is_refused_clearly(registry: Registry, case: str, error: type[Exception],
                                               match: str) -> None:
    repo = "models/hostile-" + "".join(c if c.isalnum() else "-" for c in case)  # a repository name
    blob = registry.put_blob(repo, b"hello")
    layers = {
        "traversal": [_layer(blob, "../../etc/cron.d/x")],
        "absolute": [_layer(blob, "/etc/passwd")],
        "unknown media type": [_layer(blob, "w.exe", "application/vnd.cncf.model.weight.v1.exe")],
        "tar+zstd layer": [_layer(blob, "weights", "application/vnd.cncf.model.weight.v1.tar+zstd")],
        "the store's own name": [_layer(blob, ".weightcache/layers/" + blob.partition(":")[2])],
        "twice": [_layer(blob, "a.bin"), _layer(blob, "a.bin")],
        "no name": [{"mediaType": RAW, "digest": blob, "size": 5}],
        "huge layer count": [_layer(blob, f"f{i}") for i in range(10_001)],
    }[case]
    with pytest.raises(error, match=match):
        _hostile(registry, repo, layers).list()


def test_registry_answers_never_trusted_for_digests_or_sizes(registry: Registry) -> None:
    blob = registry.put_blob("models/hostile-fields", b"hello")
    pushed = 0
    source: OciSource | None
    cases: list[tuple[dict[str, Any], str]] = [({"size": -1}, "not a byte count"), ({"size": True}, "not a byte count"),
                       ({"digest": "sha512:" + "a" * 128}, "sha256"), ({"mediaType": "no type"}, "not a media type"),
                       ({"annotations": {FILEPATH: 5}}, "string-to-string")]
    for bad, match in cases:
        try:
            source = _hostile(registry, "models/hostile-fields", [{**_layer(blob, "x.bin"), **bad}])
        except Exception:  # the registry itself refused the manifest (400): the parser alone below
            source = None
        if source is not None:
            pushed += 1
            with pytest.raises(SourceError, match=match):
                source.list()
        with pytest.raises(SourceError, match=match):  # a registry that does not check its manifests
            _descriptor({**_layer(blob, "x.bin"), **bad}, "layer 0")
    assert pushed >= 2  # size -1 and a malformed media type reach us through the real registry


def test_a_registry_on_loopback_is_plain_http_and_others_need_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    assert plain_http("127.0.0.1:5000") and plain_http("[::1]:5000") and plain_http("localhost")
    assert not plain_http("registry.example.com:5000")
    monkeypatch.setenv("WEIGHTCACHE_OCI_INSECURE_REGISTRIES", "registry.example.com:5000, other.example")
    assert plain_http("registry.example.com:5000") and plain_http("other.example")
    assert not plain_http("registry.example.com:6000")
    assert open_source(parse_ref("oci://ghcr.io/org/model:v1")).base.startswith("https://")  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry.start(tmp_path_factory.mktemp("private"), auth=("alice", "s3cret"))
    reg.push("models/private:v1", files("private"))
    yield reg
    reg.stop()


def test_basic_auth_from_a_docker_config_file(tmp_path: Path, private: Registry,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    text = f"oci://{private.host}/models/private:v1"
    with pytest.raises(SourceAccessDeniedError, match="none found"):
        fetch(tmp_path / "a", text)
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "wrong", private.host, "alice", "nope")))
    with pytest.raises(SourceAccessDeniedError, match="refuses the credentials"):
        fetch(tmp_path / "a", text)
    monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "docker", f"http://{private.host}/v2/",
                                                          "alice", "s3cret")))
    assert tree(fetch(tmp_path / "a", text)) == files("private")
    # a kubernetes.io/dockerconfigjson pull secret mounted as a directory
    secret = docker_config(tmp_path / "secret", private.host, "alice", "s3cret", name=".dockerconfigjson")
    monkeypatch.setenv("DOCKER_CONFIG", str(secret))
    assert tree(fetch(tmp_path / "b", text)) == files("private")


class _BearerFront:
    """A registry front that asks for a Bearer token (WWW-Authenticate -> a token endpoint of its own that wants
    Basic credentials), then relays to the real registry: how Docker Hub, GHCR and Harbor authenticate."""

    TOKEN = "tok-" + "x" * 40

    def __init__(self, backend: Registry, user: str, password: str) -> None:
        front = self
        self.backend, self.basic = backend, "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode()
        self.tokens_issued = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                if self.path.startswith("/token?"):
                    if self.headers.get("Authorization") != front.basic:
                        self.send_response(401)
                        self.send_header("Content-Length", "0")
                        self.end_headers()
                        return
                    front.tokens_issued += 1
                    body = json.dumps({"token": front.TOKEN}).encode()
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if self.headers.get("Authorization") != f"Bearer {front.TOKEN}":
                    self.send_response(401)
                    self.send_header("WWW-Authenticate", f'Bearer realm="http://127.0.0.1:{front.port}/token",'
                                                         'service="test",scope="repository:models/tiny:pull"')
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                conn = http.client.HTTPConnection("127.0.0.1", front.backend.port, timeout=10)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("range", "accept")}
                conn.request("GET", self.path, headers=headers)
                resp = conn.getresponse()
                body = resp.read()
                self.send_response(resp.status)
                for k in ("Content-Type", "Content-Range", "Docker-Content-Digest"):
                    if resp.getheader(k):
                        self.send_header(k, resp.getheader(k, ""))
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                conn.close()

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_bearer_challenge_is_answered_at_the_token_endpoint(tmp_path: Path, registry: Registry,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    want = files("bearer", big=200_000)
    registry.push("models/tiny:bearer", want)
    front = _BearerFront(registry, "bob", "hunter2")
    try:
        text = f"oci://127.0.0.1:{front.port}/models/tiny:bearer"
        with pytest.raises(SourceAccessDeniedError, match="token service refuses"):
            fetch(tmp_path / "a", text)
        monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "docker", f"127.0.0.1:{front.port}",
                                                              "bob", "hunter2")))
        assert tree(fetch(tmp_path / "a", text)) == want
        assert 1 <= front.tokens_issued <= 8  # one token per challenge answered, not one per request
    finally:
        front.close()


@pytest.mark.e2e
def test_the_cli_prefetches_an_oci_reference(tmp_path: Path, registry: Registry) -> None:
    want = files("cli")
    registry.push("models/tiny:cli", want)
    env = {**os.environ, "DOCKER_CONFIG": str(tmp_path / "none")}
    done = weightcache("prefetch", f"oci://{registry.host}/models/tiny:cli", "--root", str(tmp_path / "root"), "-q",
                       env=env)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.strip())
    assert {p: (path / p).read_bytes() for p in want} == want
    blob = registry.blob_file("sha256:" + hashlib.sha256(want["config.json"]).hexdigest())
    blob.write_bytes(blob.read_bytes()[:-1] + b"!")  # a bit flipped behind the registry's back
    bad = weightcache("prefetch", f"oci://{registry.host}/models/tiny:cli", "--root", str(tmp_path / "root2"), "-q",
                      env=env)
    assert bad.returncode == 7, bad.stderr
