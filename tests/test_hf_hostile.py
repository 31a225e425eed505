"""A hostile hub (or mirror, or HF_ENDPOINT) replayed against the hf:// source and the fetch engine: a listing's
lfs.sha256 is a claim (it checks downloaded bytes, never links a blob or asks peers), redirects go only to the hub
or the hosts the operator allows and never carry the token elsewhere, and a malformed listing is a SourceError
naming the field, not a traceback."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.faultproxy import FaultProxy
from tests.fixtures_hub import FakeHub, ensure
from tests.peers_fleet import Fleet
from tests.sample import make_model
from weightcache.errors import IntegrityError, SourceError
from weightcache.fetch import Fetcher
from weightcache.sources.hf import HfSource
from weightcache.store import Snapshot, Store
from weightcache.uri import parse_ref

EVIL = "evil/m"
WEIGHTS = "weights.safetensors"


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch, fake_hub: FakeHub, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("WEIGHTCACHE_HF_REDIRECT_HOSTS", "localhost")  # the fake hub's CDN


def victim(tmp_path: Path, fetcher: Fetcher) -> tuple[Snapshot, bytes]:
    """Another tenant's model on the node (any source: here a directory), and its weights' bytes."""
    make_model(tmp_path / "victim", layers=1, hidden=64, shards=1)
    snap = ensure(fetcher, f"file://{tmp_path / 'victim'}/")
    weights = next(f for f in snap.files if f.path.endswith(".safetensors"))
    return snap, (snap.path / weights.path).read_bytes()


def attacker_repo(hub: FakeHub, tmp_path: Path, body: bytes) -> None:
    (tmp_path / "evil").mkdir()
    (tmp_path / "evil" / WEIGHTS).write_bytes(body)
    (tmp_path / "evil" / "config.json").write_text("{}")
    hub.add(EVIL, tmp_path / "evil")


def tensors(n: int) -> bytes:
    """A valid safetensors file of about n bytes (the fetch checks headers of *.safetensors)."""
    import numpy as np
    from safetensors.numpy import save

    return save({"w": np.full(n, 7, dtype=np.uint8)})


def downloads(hub: FakeHub) -> list[str]:
    return [s.path for s in hub.seen if s.path.startswith("/cdn/")]


def test_a_hub_claiming_another_models_digest_links_nothing_and_is_refused(fake_hub: FakeHub,
                                                                          tmp_path: Path) -> None:
    fetcher = Fetcher(Store(tmp_path / "root"))
    snap, body = victim(tmp_path, fetcher)
    digest = hashlib.sha256(body).hexdigest()
    blob = fetcher.store.layout.blob(digest)
    links = os.stat(blob).st_nlink
    attacker_repo(fake_hub, tmp_path, b"\0" * len(body))  # the victim's size: sizes of public models are public
    fake_hub.claims[WEIGHTS] = digest

    with pytest.raises(IntegrityError, match=WEIGHTS) as err:
        ensure(fetcher, f"hf://{EVIL}")
    assert err.value.answer.exit_code == 7
    assert downloads(fake_hub), "the file was linked on the hub's word, without a byte downloaded"
    assert [i.snapshot.id for i in fetcher.store.list()] == [snap.id]
    assert os.stat(blob).st_nlink == links, "the victim's blob was linked into the hub's snapshot"


def test_a_hub_serving_the_bytes_it_claims_is_downloaded_and_stored_under_their_digest(
        fake_hub: FakeHub, tmp_path: Path) -> None:
    fetcher = Fetcher(Store(tmp_path / "root"))
    _, body = victim(tmp_path, fetcher)
    attacker_repo(fake_hub, tmp_path, body)  # a hub that really holds these bytes (its listing is then true)

    snap = ensure(fetcher, f"hf://{EVIL}")
    ranges = [s.range for s in fake_hub.seen if s.path.startswith("/cdn/")]
    assert ranges, "linked without a download: only the node's own evidence may skip one"
    assert (snap.path / WEIGHTS).read_bytes() == body
    assert {f.path: f.sha256 for f in snap.files}[WEIGHTS] == hashlib.sha256(body).hexdigest()


def test_peers_are_never_asked_for_a_digest_the_hub_claims(fake_hub: FakeHub, tmp_path: Path) -> None:
    with Fleet(tmp_path / "fleet", b"t" * 32) as fleet:
        holder = fleet.node("holder")
        _, body = victim(tmp_path, holder.fetcher())
        attacker_repo(fake_hub, tmp_path, b"\0" * len(body))
        fake_hub.claims[WEIGHTS] = hashlib.sha256(body).hexdigest()
        with FaultProxy(holder.url) as watch:
            node = fleet.node("node", peers=[watch.endpoint_url])
            with pytest.raises(IntegrityError):  # a peer would have served the victim's bytes for the claim
                ensure(node.fetcher(), f"hf://{EVIL}")
            assert watch.requests == []
        assert not node.store.list()


def test_a_redirect_to_a_host_not_allowed_is_refused_before_any_request_reaches_it(
        fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    attacker_repo(fake_hub, tmp_path, tensors(100))
    monkeypatch.setenv("WEIGHTCACHE_HF_REDIRECT_HOSTS", "cdn.example")  # localhost is not among them
    with pytest.raises(SourceError, match="WEIGHTCACHE_HF_REDIRECT_HOSTS") as err:
        ensure(Fetcher(Store(tmp_path / "root")), f"hf://{EVIL}")
    assert "'localhost'" in str(err.value) and fake_hub.token not in str(err.value)
    assert not [s for s in fake_hub.seen if s.host.startswith("localhost")]
    # allowed, the CDN is reached without the token, which only the hub's own host gets
    monkeypatch.setenv("WEIGHTCACHE_HF_REDIRECT_HOSTS", "cdn.example, localhost")
    snap = ensure(Fetcher(Store(tmp_path / "root")), f"hf://{EVIL}")
    assert (snap.path / WEIGHTS).read_bytes() == tensors(100)
    cdn = [s for s in fake_hub.seen if s.host.startswith("localhost")]
    assert cdn and all(s.authorization is None for s in cdn)
    assert all(s.authorization == f"Bearer {fake_hub.token}" for s in fake_hub.seen if s.host.startswith("127."))


def test_a_redirect_loop_costs_a_bounded_count_of_requests(fake_hub: FakeHub, tmp_path: Path) -> None:
    attacker_repo(fake_hub, tmp_path, tensors(100))
    fake_hub.redirect = "loop"
    with pytest.raises(SourceError, match="more than 5 redirects"):
        ensure(Fetcher(Store(tmp_path / "root")), f"hf://{EVIL}")
    assert len([s for s in fake_hub.seen if "/resolve/" in s.path]) <= 6 * 5  # 6 requests per attempt, 5 attempts


@pytest.mark.parametrize(("hub", "location", "allowed"), [
    ("https://hub.example", "http://hub.example/x", "https"),  # a downgrade, even to the hub's own host name
    ("https://hub.example", "https://evil.example/x", "neither the hub nor"),
    ("https://hub.example", "https://cdn.example.evil/x", "neither the hub nor"),  # a suffix is not a subdomain
    ("https://hub.example", "file:///etc/passwd", "https"),
])
def test_redirect_rule(monkeypatch: pytest.MonkeyPatch, hub: str, location: str, allowed: str) -> None:
    monkeypatch.setenv("HF_ENDPOINT", hub)
    monkeypatch.setenv("WEIGHTCACHE_HF_REDIRECT_HOSTS", "cdn.example")
    source = HfSource(parse_ref("hf://org/name"))
    with pytest.raises(SourceError, match=allowed):
        source._allowed(location, "GET x")
    source._allowed("https://eu.cdn.example/x", "GET x")  # a subdomain of an allowed host
    source._allowed("https://hub.example/other", "GET x")


def test_the_public_hub_allows_its_own_cdns_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HF_ENDPOINT")
    monkeypatch.delenv("WEIGHTCACHE_HF_REDIRECT_HOSTS")
    source = HfSource(parse_ref("hf://org/name"))
    for cdn in ("https://cdn-lfs-us-1.hf.co/x", "https://cas-bridge.xethub.hf.co/x", "https://cdn-lfs.huggingface.co/x"):
        source._allowed(cdn, "GET x")
    with pytest.raises(SourceError):
        source._allowed("https://evil-hf.co/x", "GET x")


def _sibling(**fields: object) -> bytes:
    entry = {"rfilename": "w.bin", "size": 3, **fields}
    return json.dumps({"sha": "a" * 40, "siblings": [entry]}).encode()


@pytest.mark.parametrize(("listing", "field"), [
    (b"<html>not json</html>", "not valid JSON"),
    (b"[" * 100_000, "nested deeper"),
    (b'"a string"', r"\(body\)"),
    (json.dumps({"sha": "a" * 40, "siblings": {"w": 1}}).encode(), "siblings = "),
    (json.dumps({"sha": "../../etc", "siblings": []}).encode(), "sha = "),
    (json.dumps({"siblings": []}).encode(), "sha = None"),
    (json.dumps({"sha": "a" * 40, "siblings": ["w.bin"]}).encode(), r"siblings\[0\] = "),
    (_sibling(rfilename=7), r"siblings\[0\]\.rfilename"),
    (_sibling(size=-1), r"siblings\[0\] \('w.bin'\)\.size = -1"),
    (_sibling(size="²"), r"\.size = '²'"),
    (_sibling(size=1 << 60), r"\.size = 1152921504606846976"),
    (_sibling(size=2.5), r"\.size = 2.5"),
    (_sibling(size=True), r"\.size = True"),
    (_sibling(size=None), r"\.size = None"),
    (_sibling(lfs={"sha256": "zz", "size": 3}), r"\.lfs\.sha256 = 'zz'"),
    (_sibling(lfs={"sha256": "a" * 64, "size": 4}), r"\.lfs\.size = 4"),
    (_sibling(lfs=[1]), r"\.lfs = \[1\]"),
    (_sibling(blobId={"x": 1}), r"\.blobId"),
])
def test_a_malformed_listing_is_a_source_error_naming_the_field(fake_hub: FakeHub, tmp_path: Path,
                                                                listing: bytes, field: str) -> None:
    attacker_repo(fake_hub, tmp_path, tensors(3))
    fake_hub.listing = listing
    with pytest.raises(SourceError, match=field) as err:
        ensure(Fetcher(Store(tmp_path / "root")), f"hf://{EVIL}")
    assert "HF_ENDPOINT" in str(err.value)  # says what to check
    assert len(str(err.value)) < 600


def test_a_quoted_size_of_ascii_digits_is_read(fake_hub: FakeHub, tmp_path: Path) -> None:
    attacker_repo(fake_hub, tmp_path, tensors(3))
    fake_hub.patch["config.json"] = {"size": "2"}  # some mirrors quote numbers
    snap = ensure(Fetcher(Store(tmp_path / "root")), f"hf://{EVIL}")
    assert (snap.path / "config.json").read_text() == "{}"


def test_a_listing_larger_than_the_bound_is_refused_without_reading_it_all(
        fake_hub: FakeHub, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from weightcache.sources import hf

    monkeypatch.setattr(hf, "MAX_LISTING_BYTES", 1 << 20)
    attacker_repo(fake_hub, tmp_path, tensors(3))
    fake_hub.listing = b" " * (4 << 20)
    with pytest.raises(SourceError, match="over 1 MiB"):
        ensure(Fetcher(Store(tmp_path / "root")), f"hf://{EVIL}")
