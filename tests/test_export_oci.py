"""`weightcache export`: a cached snapshot pushed to a real registry (docker-registry on 127.0.0.1) as a ModelPack
artifact, read back with `oci://` into a fresh store and parsed by the oras SDK; blobs the registry has are
skipped (HEAD), big files go up in chunks (PATCH), Basic auth comes from the docker config, and the CLI."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.command import weightcache
from tests.fixtures_registry import Registry, docker_config
from tests.grants import granted
from weightcache.errors import InvalidReferenceError, SourceAccessDeniedError
from weightcache.fetch import Fetcher
from weightcache.sources import oci_export
from weightcache.sources.oci_export import export_snapshot, media_type
from weightcache.store import Snapshot, Store
from weightcache.uri import parse_ref


def model(seed: str, big: int = 0) -> dict[str, bytes]:
    out = {"config.json": json.dumps({"seed": seed}).encode(), "tokenizer/tokenizer.json": f"tok {seed}".encode(),
           "README.md": f"# {seed}".encode(), "empty.txt": b""}
    out["model.safetensors"] = safetensors(hashlib.sha256(seed.encode()).digest() * max(1, big // 32))
    return out


def safetensors(data: bytes) -> bytes:
    """A valid safetensors file holding `data` as one U8 tensor (the engine checks every header)."""
    header = json.dumps({"w": {"dtype": "U8", "shape": [len(data)], "data_offsets": [0, len(data)]}}).encode()
    header += b" " * (-len(header) % 8)
    return len(header).to_bytes(8, "little") + header + data


def cached(root: Path, tmp: Path, files: dict[str, bytes]) -> Snapshot:
    """A snapshot in the store at `root`, fetched from a file:// directory."""
    src = tmp / f"src-{hashlib.sha256(repr(sorted(files)).encode() + files['config.json']).hexdigest()[:8]}"
    for relpath, data in files.items():
        (src / relpath).parent.mkdir(parents=True, exist_ok=True)
        (src / relpath).write_bytes(data)
    return Fetcher(Store(root)).ensure(granted(f"file://{src}/"))


def tree(snap: Snapshot) -> dict[str, bytes]:
    return {f.path: (snap.path / f.path).read_bytes() for f in snap.files}


def test_an_exported_snapshot_comes_back_byte_for_byte(tmp_path: Path, registry: Registry) -> None:
    want = model("roundtrip", big=100_000)
    snap = cached(tmp_path / "a", tmp_path, want)
    done = export_snapshot(snap, parse_ref(f"oci://{registry.host}/models/exported:v1"))
    assert done.files == len(want) and done.uploaded == len(want) + 1 and done.skipped == 0
    back = Fetcher(Store(tmp_path / "b"), chunk_size=64 << 10).ensure(
        granted(f"oci://{registry.host}/models/exported:v1"))
    assert tree(back) == want
    by_digest = Fetcher(Store(tmp_path / "c")).ensure(granted(f"oci://{registry.host}/models/exported@{done.digest}"))
    assert tree(by_digest) == want

    manifest = registry.client().get_manifest(f"{registry.host}/models/exported:v1")  # oras parses it
    assert manifest["artifactType"] == "application/vnd.cncf.model.manifest.v1+json"
    assert manifest["config"]["mediaType"] == "application/vnd.cncf.model.config.v1+json"
    names = {layer["annotations"]["org.cncf.model.filepath"]: layer for layer in manifest["layers"]}
    assert set(names) == set(want)
    assert all(layer["digest"] == "sha256:" + hashlib.sha256(want[n]).hexdigest() and layer["size"] == len(want[n])
               for n, layer in names.items())
    assert names["model.safetensors"]["mediaType"] == "application/vnd.cncf.model.weight.v1.raw"
    assert names["config.json"]["mediaType"] == "application/vnd.cncf.model.weight.config.v1.raw"
    assert names["README.md"]["mediaType"] == "application/vnd.cncf.model.doc.v1.raw"
    config = json.loads(registry._call("GET", f"/v2/models/exported/blobs/{manifest['config']['digest']}", None,
                                       {}).read())
    assert config["modelfs"] == {"type": "layers", "diff_ids": [layer["digest"] for layer in manifest["layers"]]}
    assert config["descriptor"]["name"] == "exported" and config["config"] == {"format": "safetensors"}
    assert config["descriptor"]["createdAt"].endswith("Z")


def test_blobs_the_registry_has_are_skipped_and_big_files_go_up_in_chunks(
        tmp_path: Path, registry: Registry, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(oci_export, "MONOLITHIC_MAX", 64 << 10)
    monkeypatch.setattr(oci_export, "CHUNK", 100_000)
    want = model("chunked", big=350_000)  # four PATCHes, the last one short
    snap = cached(tmp_path / "a", tmp_path, want)
    first = export_snapshot(snap, parse_ref(f"oci://{registry.host}/models/chunked:v1"))
    again = export_snapshot(snap, parse_ref(f"oci://{registry.host}/models/chunked:v2"))
    assert first.uploaded == len(want) + 1
    # every file's blob is skipped; the config too unless a second passed (it carries createdAt)
    assert again.skipped >= len(want) and again.uploaded == len(want) + 1 - again.skipped
    for tag in ("v1", "v2"):
        back = Fetcher(Store(tmp_path / f"b-{tag}")).ensure(granted(f"oci://{registry.host}/models/chunked:{tag}"))
        assert tree(back) == want


def test_export_to_a_registry_with_basic_auth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    reg = Registry.start(tmp_path / "private", auth=("alice", "s3cret"))
    try:
        snap = cached(tmp_path / "a", tmp_path, model("private"))
        target = parse_ref(f"oci://{reg.host}/models/private:v1")
        with pytest.raises(SourceAccessDeniedError, match="none found"):
            export_snapshot(snap, target)
        monkeypatch.setenv("DOCKER_CONFIG", str(docker_config(tmp_path / "docker", reg.host, "alice", "s3cret")))
        export_snapshot(snap, target)
        back = Fetcher(Store(tmp_path / "b")).ensure(granted(str(target)))
        assert tree(back) == model("private")
    finally:
        reg.stop()


def test_export_refuses_what_it_cannot_push(tmp_path: Path, registry: Registry) -> None:
    snap = cached(tmp_path / "a", tmp_path, model("refused"))
    with pytest.raises(InvalidReferenceError, match="not a digest"):
        export_snapshot(snap, parse_ref(f"oci://{registry.host}/models/x@sha256:{'a' * 64}"))
    with pytest.raises(InvalidReferenceError, match="oci://"):
        export_snapshot(snap, parse_ref("s3://bucket/models/x/"))


def test_media_types_follow_modelpack() -> None:
    assert media_type("model-00001-of-00002.safetensors").endswith(".weight.v1.raw")
    assert media_type("sub/pytorch_model.bin").endswith(".weight.v1.raw")
    assert media_type("tokenizer.json").endswith(".weight.config.v1.raw")
    assert media_type("LICENSE").endswith(".doc.v1.raw") and media_type("README.md").endswith(".doc.v1.raw")
    assert media_type("modeling_x.py").endswith(".code.v1.raw")


@pytest.mark.e2e
def test_the_cli_exports_and_prints_json(tmp_path: Path, registry: Registry) -> None:
    want = model("cli")
    snap = cached(tmp_path / "root", tmp_path, want)
    env = {**os.environ, "DOCKER_CONFIG": str(tmp_path / "none")}
    target = f"oci://{registry.host}/models/cli:v1"
    done = weightcache("export", snap.id[:12], target, "--root", str(tmp_path / "root"), "-o", "json", env=env)
    assert done.returncode == 0, done.stderr
    body = json.loads(done.stdout)
    assert body["snapshot"] == snap.id and body["target"] == target and body["files"] == len(want)
    assert body["digest"].startswith("sha256:")
    back = Fetcher(Store(tmp_path / "b")).ensure(granted(f"oci://{registry.host}/models/cli@{body['digest']}"))
    assert tree(back) == want
    push = weightcache("push", "nothing-like-it", target, "--root", str(tmp_path / "root"), env=env)
    assert push.returncode != 0 and "nothing cached" in push.stderr
