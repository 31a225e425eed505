"""A directory pushed with the oras Python SDK: one `application/vnd.oci.image.layer.v1.tar+gzip` layer titled with
the directory's name and no `io.deis.oras.content.unpack` annotation, which oras-py unpacks on pull. It is unpacked
the same way (its members are the model's files). Before: cached as one 229-byte gzip file named like the
directory, exit 0, a model nobody could load. A file of that type titled like an archive stays a file."""

from __future__ import annotations

import gzip
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures_registry import Registry
from tests.grants import granted
from weightcache.fetch import Fetcher
from weightcache.store import Store

TGZ = "application/vnd.oci.image.layer.v1.tar+gzip"  # oras-py's media type for a directory


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry.start(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


def tree(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_a_directory_pushed_by_oras_py_is_unpacked(registry: Registry, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    model = tmp_path / "push" / "tiny"
    (model / "sub").mkdir(parents=True)
    files = {"config.json": b"{}", "sub/w.bin": os.urandom(4096)}
    for name, data in files.items():
        (model / name).write_bytes(data)
    archive = tmp_path / "push" / "weights.tar.gz"
    archive.write_bytes(gzip.compress(b"not unpacked: a file that is an archive"))
    monkeypatch.chdir(tmp_path / "push")  # oras-py pushes paths under the working directory
    registry.client().push(target=f"{registry.host}/models/orasdir:v1", files=["tiny", f"weights.tar.gz:{TGZ}"],
                            quiet=True)
    manifest = registry.manifest("models/orasdir", "v1")
    assert [(layer["mediaType"], layer["annotations"]) for layer in manifest["layers"]] == [
        (TGZ, {"org.opencontainers.image.title": "tiny"}),
        (TGZ, {"org.opencontainers.image.title": "weights.tar.gz"})]

    snap = Fetcher(Store(tmp_path / "root")).ensure(granted(f"oci://{registry.host}/models/orasdir:v1"))
    assert tree(snap.path) == {**{f"tiny/{k}": v for k, v in files.items()},
                               "weights.tar.gz": archive.read_bytes()}
