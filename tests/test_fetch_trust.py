"""What a hostile source can claim, and what the fetch engine believes: claims never replace bytes."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.fixtures_s3 import S3
from tests.grants import admin, granted
from tests.sample import make_model
from weightcache.errors import IntegrityError
from weightcache.fetch import Fetcher
from weightcache.store import Store
from weightcache.uri import parse_ref


@pytest.mark.parametrize("same_size", [False, True], ids=["1-byte", "same-size"])
@pytest.mark.parametrize("sidecar", ["SHA256SUMS", "weights.safetensors.sha256"])
def test_a_sidecar_naming_another_models_digest_never_links_that_blob(tmp_path: Path, s3: S3, sidecar: str,
                                                                      same_size: bool) -> None:
    make_model(tmp_path / "victim", layers=1, hidden=64, shards=1)
    s3.upload_dir(tmp_path / "victim", "victim", "private/")
    fetcher = Fetcher(Store(tmp_path / "root"), endpoint_url=s3.endpoint_url)
    victim = fetcher.ensure(granted("s3://victim/private/"))
    target = next(f for f in victim.files if f.path.endswith(".safetensors"))
    blob = fetcher.store.layout.blob(target.sha256)
    links = os.stat(blob).st_nlink

    # a placeholder; sizes of public models are public too
    s3.put("attacker", "m/weights.safetensors", b"\0" * target.size if same_size else b"x")
    line = f"{target.sha256}  weights.safetensors\n" if sidecar == "SHA256SUMS" else f"{target.sha256}\n"
    s3.put("attacker", f"m/{sidecar}", line.encode())

    with pytest.raises(IntegrityError, match=r"weights\.safetensors"):
        fetcher.ensure(granted("s3://attacker/m/"))

    assert [i.snapshot.id for i in fetcher.store.list()] == [victim.id]
    assert os.stat(blob).st_nlink == links, "the victim's blob was linked into another snapshot"


def test_a_true_sidecar_still_checks_the_bytes_it_names(tmp_path: Path, s3: S3) -> None:
    import hashlib

    body = b"weights"
    s3.put("models", "m/w.bin", body)
    s3.put("models", "m/SHA256SUMS", f"{hashlib.sha256(body).hexdigest()} *./w.bin\n".encode())
    snap = Fetcher(Store(tmp_path / "root"), endpoint_url=s3.endpoint_url).ensure(granted("s3://models/m/"))
    assert (snap.path / "w.bin").read_bytes() == body
    assert {f.path: f.size for f in snap.files}["w.bin"] == len(body)


@pytest.mark.parametrize("in_place", [True, False])
def test_a_symlink_planted_at_a_small_files_partial_is_replaced_not_followed(tmp_path: Path, in_place: bool,
                                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    import hashlib

    from weightcache.store import blobwrite

    if not in_place:  # without /proc a small file goes to a part, as where the filesystem lacks O_TMPFILE
        monkeypatch.setattr(blobwrite, "_PROC_FD", str(tmp_path / "no-proc"))
    src = tmp_path / "model"
    src.mkdir()
    (src / "config.json").write_bytes(b'{"a": 1}')
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    ref = parse_ref(f"file://{src}/")
    store = Store(tmp_path / "root")
    part = store.layout.partial / f"{ref.key}.{hashlib.sha256(b'config.json').hexdigest()[:16]}.part"
    part.symlink_to(victim)
    snap = Fetcher(store).ensure(admin(ref))
    assert (snap.path / "config.json").read_bytes() == b'{"a": 1}'
    assert victim.read_bytes() == b"precious"
    assert not part.is_symlink()  # a leftover at a small file's part is removed before the round, never followed
