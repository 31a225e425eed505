"""Fleet fill for buckets filled the usual way (no SHA-256 checksum): peers are asked by the origin's identity
(bucket, key, ETag, version, size), serve it only from records of their own downloads of that identity, and the
asking node checks the bytes against the origin's MD5 ETag (single part or multipart) or full-object CRC.
Real parts: moto behind the fault proxy (it counts origin bytes), real peer servers (docs/peers.md,
"Objects without a SHA-256 checksum")."""

from __future__ import annotations

import io
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import boto3.s3.transfer
import pytest
import urllib3

from tests.faultproxy import FaultProxy
from tests.fixtures_s3 import S3
from tests.grants import admin
from tests.peers_fleet import Fleet, FleetNode, origin_bytes
from weightcache.peers.identity import OriginId
from weightcache.store import Snapshot
from weightcache.uri import ModelRef, parse_ref

TOKEN = b"peer-token-0123456789abcdef"
OPTIONS = {"chunk_size": 256 << 10, "concurrency": 4}
PLAIN = {"model-00001.safetensors.bin": os.urandom(3 << 20) + b"a", "model-00002.bin": os.urandom(2 << 20),
         "config.json": b'{"hidden": 64}'}
MULTIPART = {"big.bin": os.urandom(12 << 20) + b"tail"}  # 5 MiB parts: 3 parts, ETag "...-3"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    with Fleet(tmp_path, TOKEN) as f:
        yield f


def put_plain(s3: S3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    for name, body in files.items():  # boto3's default: put_object, the store adds a CRC32; the ETag is the MD5
        s3.put(bucket, prefix + name, body)


def put_multipart(s3: S3, bucket: str, prefix: str, files: dict[str, bytes]) -> None:
    s3.create_bucket(bucket)
    config = boto3.s3.transfer.TransferConfig(multipart_threshold=5 << 20, multipart_chunksize=5 << 20)
    for name, body in files.items():  # as `aws s3 cp` does it: uniform parts, the ETag an MD5 of part MD5s
        s3.client.upload_fileobj(io.BytesIO(body), bucket, prefix + name, Config=config)


def ensure(node: FleetNode, proxy: FaultProxy, ref: ModelRef) -> Snapshot:
    return node.fetcher(endpoint_url=proxy.endpoint_url, **OPTIONS).ensure(admin(ref))


def assert_files(snap: Snapshot, files: dict[str, bytes]) -> None:
    for name, body in files.items():
        assert (snap.path / name).read_bytes() == body


def two_nodes(fleet: Fleet, proxy: FaultProxy, ref: ModelRef, files: dict[str, bytes]) -> tuple[FleetNode, int, int]:
    """A fetches alone, then B with A as its peer: (B, B's origin bytes, B's peer bytes)."""
    a = fleet.node("a")
    assert_files(ensure(a, proxy, ref), files)
    before = origin_bytes(proxy, f"/{ref.bucket}/")
    b = fleet.node("b", peers=[a.url])
    assert_files(ensure(b, proxy, ref), files)
    from_origin = origin_bytes(proxy, f"/{ref.bucket}/") - before
    from_peer = b.fetchers[-1].stats["peer_bytes"]
    total = sum(len(v) for v in files.values())
    print(f"\n{ref.uri}: model {total} B; second node: origin {from_origin} B, peer {from_peer} B "
          f"({from_peer / total:.1%} from its peer)")
    return b, from_origin, from_peer


def test_a_plain_put_object_bucket_fills_the_second_node_from_its_peer(s3: S3, fault_proxy: FaultProxy,
                                                                       fleet: Fleet) -> None:
    ref = parse_ref("s3://plain/llama/")
    put_plain(s3, "plain", "llama/", PLAIN)
    b, from_origin, from_peer = two_nodes(fleet, fault_proxy, ref, PLAIN)
    total = sum(len(v) for v in PLAIN.values())
    assert from_peer >= 0.9 * total
    # config.json is below MIN_PEER_BYTES (not worth a HEAD of its own); A, B's only holder, had its first piece
    # judged by the origin's bytes before use (docs/peers.md, "The lying peer")
    assert len(PLAIN["config.json"]) < from_origin <= len(PLAIN["config.json"]) + OPTIONS["chunk_size"]
    assert not b.peers.stats.errors_by_peer


def test_a_multipart_bucket_fills_the_second_node_from_its_peer(s3: S3, fault_proxy: FaultProxy,
                                                                fleet: Fleet) -> None:
    ref = parse_ref("s3://multi/llama/")
    put_multipart(s3, "multi", "llama/", MULTIPART)
    assert s3.client.head_object(Bucket="multi", Key="llama/big.bin")["ETag"].endswith('-3"')
    b, from_origin, from_peer = two_nodes(fleet, fault_proxy, ref, MULTIPART)
    assert from_peer >= 0.9 * len(MULTIPART["big.bin"])
    assert 0 < from_origin <= OPTIONS["chunk_size"]  # A's first piece, judged by the origin's bytes
    assert not b.peers.stats.errors_by_peer


def _blob_of(node: FleetNode, snap: Snapshot, name: str) -> Path:
    st = (snap.path / name).stat()
    for path in node.store.layout.blobs.rglob("*"):
        if path.is_file() and path.stat().st_ino == st.st_ino:
            return path
    raise AssertionError(f"no blob for {name}")


@pytest.mark.parametrize("upload", ["plain", "multipart"])
def test_a_peer_serving_other_bytes_for_an_identity_is_caught_by_the_origin_checksum_and_banned(
        s3: S3, fault_proxy: FaultProxy, fleet: Fleet, upload: str) -> None:
    files = PLAIN if upload == "plain" else MULTIPART
    (put_plain if upload == "plain" else put_multipart)(s3, "bkt", "m/", files)
    ref = parse_ref("s3://bkt/m/")
    liar = fleet.node("liar")
    snap = ensure(liar, fault_proxy, ref)
    name = max(files, key=lambda n: len(files[n]))
    blob = _blob_of(liar, snap, name)  # the liar's blob now holds other bytes of the same size
    os.chmod(blob, stat.S_IWUSR | stat.S_IRUSR)
    with open(blob, "r+b") as f:
        f.seek(len(files[name]) // 2)
        f.write(b"\x00not the origin's bytes\x00")
    honest = fleet.node("honest", peers=[liar.url])
    assert_files(ensure(honest, fault_proxy, ref), files)  # MD5 / part-MD5 mismatch, then the origin
    assert liar.url in honest.peers.stats.banned
    print(f"\n{upload}: liar banned; errors {honest.peers.stats.errors_by_peer}")


def test_a_hostile_bucket_cannot_make_an_honest_node_serve_another_tenants_blob(s3: S3, fault_proxy: FaultProxy,
                                                                                fleet: Fleet) -> None:
    """The victim's model is on node A. A bucket another tenant controls holds an object under the same key and
    size, and its listing could name the victim's ETag: A answers only for the identity it downloaded itself
    (bucket and key included), so nothing but the victim's own bucket maps to the victim's blob."""
    secret = {"w.bin": os.urandom(2 << 20)}
    put_plain(s3, "victim", "m/", secret)
    a = fleet.node("a")
    ensure(a, fault_proxy, parse_ref("s3://victim/m/"))
    head = s3.client.head_object(Bucket="victim", Key="m/w.bin")
    etag, size = head["ETag"].strip('"'), head["ContentLength"]
    real = OriginId("s3", "victim", "m/w.bin", etag, None, size)
    pool = urllib3.PoolManager()
    auth = {"Authorization": "Bearer " + TOKEN.decode()}

    def status(oid: OriginId) -> int:
        from weightcache.peers.client import PeerClient

        url = PeerClient(a.url, TOKEN, connect_timeout=2, read_timeout=5).blob_url(oid)
        return int(pool.request("HEAD", url, headers=auth).status)

    assert status(real) == 200
    aliases = {
        "another bucket, same key, ETag and size": OriginId("s3", "evil", "m/w.bin", etag, None, size),
        "same bucket, another key": OriginId("s3", "victim", "evil/w.bin", etag, None, size),
        "same bucket, a prefix of the key": OriginId("s3", "victim", "w.bin", etag, None, size),
        "another ETag": OriginId("s3", "victim", "m/w.bin", "0" * 32, None, size),
        "another size": OriginId("s3", "victim", "m/w.bin", etag, None, size - 1),
        "another version": OriginId("s3", "victim", "m/w.bin", etag, "v2", size),
    }
    for what, oid in aliases.items():
        got = status(oid)
        print(f"{what}: {got}")
        assert got == 404 if what != "another version" else got in (404, 200)
    # end to end: the hostile bucket's model, same key and size, comes from its own origin only
    evil = {"w.bin": os.urandom(2 << 20)}
    put_plain(s3, "evil", "m/", evil)
    b = fleet.node("b", peers=[a.url])
    assert_files(ensure(b, fault_proxy, parse_ref("s3://evil/m/")), evil)
    assert b.fetchers[-1].stats["peer_bytes"] == 0
