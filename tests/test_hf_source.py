"""hf://org/name[@revision] through huggingface_hub against a local server that speaks the hub's API: HF_ENDPOINT
and tokens (HF_TOKEN, a token file) honoured, the token sent to the hub's host only and never logged, every
byte read from the listed commit, and the result loads offline as `org/name` from the hub cache layout."""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import pytest

from tests.fixtures_hf import HubLoader, tiny_llama
from tests.fixtures_hub import COMMIT, FakeHub, ensure
from weightcache.errors import SourceNotFoundError, WeightcacheError
from weightcache.fetch import Fetcher
from weightcache.hf_layout import commit_of, hub_cache
from weightcache.sources import open_source
from weightcache.store import Store
from weightcache.uri import parse_ref

REPO = "acme/tiny-llama"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[int]]:
    path = tmp_path_factory.mktemp("hub") / "tiny-llama"
    return path, tiny_llama(tmp_path_factory, path)


@pytest.fixture(autouse=True)
def hub_env(monkeypatch: pytest.MonkeyPatch, fake_hub: FakeHub, tmp_path: Path) -> None:
    monkeypatch.setenv("HF_ENDPOINT", fake_hub.url)
    for name in ("HF_TOKEN", "HF_TOKEN_PATH", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no stored login of the developer leaks in
    monkeypatch.setenv("WEIGHTCACHE_HF_REDIRECT_HOSTS", "localhost")  # the fake hub's CDN


def test_public_repo_fetches_every_file_from_the_listed_commit(
        fake_hub: FakeHub, model_dir: tuple[Path, list[int]], tmp_path: Path) -> None:
    src, _ = model_dir
    repo = fake_hub.add(REPO, src)
    store = Store(tmp_path / "root")
    snapshot = ensure(Fetcher(store, chunk_size=64 << 10), f"hf://{REPO}")
    assert {e.path: (snapshot.path / e.path).read_bytes() for e in snapshot.files} == repo.files
    resolves = [s for s in fake_hub.seen if "/resolve/" in s.path]
    assert resolves and all(f"/resolve/{COMMIT}/" in s.path for s in resolves)  # pinned to the commit, not main
    assert all(s.range for s in fake_hub.seen if "/cdn/" in s.path or "/resolve/" in s.path)
    assert any(s.path.startswith("/cdn/") and s.host.startswith("localhost") for s in fake_hub.seen)


@pytest.mark.parametrize("revision", ["main", COMMIT])
def test_a_branch_or_commit_revision_fetches_and_names_the_hub_commit(
        fake_hub: FakeHub, model_dir: tuple[Path, list[int]], tmp_path: Path, revision: str) -> None:
    fake_hub.add(REPO, model_dir[0])
    store = Store(tmp_path / "root")
    snapshot = ensure(Fetcher(store), f"hf://{REPO}@{revision}")
    assert commit_of(snapshot) == COMMIT  # the hub cache layout uses the repo's real commit
    assert (hub_cache(store, snapshot, REPO, refs=(revision,)) / "models--acme--tiny-llama" / "refs" / revision
            ).read_text() == COMMIT


def test_lfs_sha256_is_a_claim_not_the_stores_checksum(fake_hub: FakeHub, model_dir: tuple[Path, list[int]]) -> None:
    src, _ = model_dir
    fake_hub.add(REPO, src)
    source = open_source(parse_ref(f"hf://{REPO}@main"))
    try:
        objects = {o.relpath: o for o in source.list()}
        weights = objects["model.safetensors"]
        claimed = source.claimed_sha256(weights)
    finally:
        source.close()
    assert claimed == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    assert weights.checksum is None  # the fetch engine links and asks peers only on a store's own checksum
    assert weights.version_id == COMMIT and objects["config.json"].checksum is None


@pytest.mark.parametrize("how", ["HF_TOKEN", "HF_TOKEN_PATH"])
def test_private_repo_needs_the_token_which_goes_to_the_hub_only_and_is_never_logged(
        fake_hub: FakeHub, model_dir: tuple[Path, list[int]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture, how: str) -> None:
    src, _ = model_dir
    fake_hub.add(REPO, src, private=True)
    store = Store(tmp_path / "root")
    with pytest.raises(SourceNotFoundError, match="HF_TOKEN") as err:
        ensure(Fetcher(store), f"hf://{REPO}")
    assert fake_hub.token not in str(err.value)

    if how == "HF_TOKEN":
        monkeypatch.setenv("HF_TOKEN", fake_hub.token)
    else:  # a Secret mounted as a file
        (tmp_path / "token").write_text(fake_hub.token + "\n")
        monkeypatch.setenv("HF_TOKEN_PATH", str(tmp_path / "token"))
    caplog.set_level(logging.DEBUG)
    fake_hub.seen.clear()
    snapshot = ensure(Fetcher(store), f"hf://{REPO}")
    assert (snapshot.path / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()
    to_hub = [s for s in fake_hub.seen if s.host.startswith("127.0.0.1")]
    to_cdn = [s for s in fake_hub.seen if s.host.startswith("localhost")]
    assert to_hub and all(s.authorization == f"Bearer {fake_hub.token}" for s in to_hub)
    assert to_cdn and all(s.authorization is None for s in to_cdn)  # redirected elsewhere: no token
    assert fake_hub.token not in caplog.text
    assert not [p for p in Path(store.root).rglob("*") if p.is_file() and fake_hub.token.encode() in p.read_bytes()]


def test_wrong_token_is_refused_without_echoing_it(
        fake_hub: FakeHub, model_dir: tuple[Path, list[int]], tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    fake_hub.add(REPO, model_dir[0], private=True)
    monkeypatch.setenv("HF_TOKEN", "hf_wrong_token_value_123456")
    with pytest.raises(WeightcacheError) as err:
        ensure(Fetcher(Store(tmp_path / "root")), f"hf://{REPO}")
    assert "hf_wrong_token_value_123456" not in str(err.value) and "refused" in str(err.value)


def test_unknown_revision_and_repo_are_not_found(fake_hub: FakeHub, model_dir: tuple[Path, list[int]],
                                                 tmp_path: Path) -> None:
    fake_hub.add(REPO, model_dir[0])
    with pytest.raises(SourceNotFoundError, match="no revision 'v9'"):
        ensure(Fetcher(Store(tmp_path / "a")), f"hf://{REPO}@v9")
    with pytest.raises(SourceNotFoundError, match="acme/other not found"):
        ensure(Fetcher(Store(tmp_path / "b")), "hf://acme/other")


def test_fetched_repo_loads_offline_as_org_name(fake_hub: FakeHub, model_dir: tuple[Path, list[int]],
                                                hub_loader: HubLoader, tmp_path: Path) -> None:
    src, reference = model_dir
    fake_hub.add(REPO, src)
    store = Store(tmp_path / "root")
    snapshot = ensure(Fetcher(store), f"hf://{REPO}")
    cache = hub_cache(store, snapshot, REPO)
    result = hub_loader.load(cache, REPO)
    assert result["tokens"] == reference
    assert str(result["path"]).endswith(commit_of(snapshot))


def test_hf_references_are_validated() -> None:
    from weightcache.errors import InvalidReferenceError

    for bad in ("hf://../x", "hf://a--b/c", "hf://-x/y"):
        with pytest.raises(InvalidReferenceError):
            parse_ref(bad)
    with pytest.raises(InvalidReferenceError, match="hf://org/name"):
        open_source(parse_ref("hf://org/name/sub"))
    assert os.environ["HF_ENDPOINT"].startswith("http://127.0.0.1:")
