"""Tar layers through the fetch engine against a real registry (docker-registry on 127.0.0.1, pushed by the oras
SDK): ModelPack `*.tar` and `*.tar+gzip` layers and an ORAS `io.deis.oras.content.unpack` directory become the
files pods see, bit-exact; hostile members, a truncated gzip, a bit-flipped blob and a damaged blob already in the
store publish nothing; globs select members; a moved tag is told by its layers' digests (docs/sources.md)."""

from __future__ import annotations

import errno
import gzip
import hashlib
import io
import os
import stat
import subprocess
import tarfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.command import weightcache
from tests.fixtures_csi import needs_root
from tests.fixtures_registry import Registry
from tests.grants import granted
from weightcache.errors import HostileKeyError, InsufficientSpaceError, IntegrityError, SourceError
from weightcache.fetch import Fetcher
from weightcache.sources import oci_tar
from weightcache.sources.oci import ORAS_UNPACK
from weightcache.store import Snapshot, Store

TAR = "application/vnd.cncf.model.weight.v1.tar"
TGZ = "application/vnd.cncf.model.weight.v1.tar+gzip"
ORAS_TGZ = "application/vnd.oci.image.layer.v1.tar+gzip"

Tweak = Callable[[tarfile.TarInfo], None] | None


def tar(members: list[tuple[str, bytes | None, Tweak]]) -> bytes:
    """A tar of (name, bytes or None for a directory, tweak of the header) as real tools write one."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for name, data, tweak in members:
            info = tarfile.TarInfo(name)
            info.type, info.size = (tarfile.DIRTYPE, 0) if data is None else (tarfile.REGTYPE, len(data))
            if tweak is not None:
                tweak(info)
            tf.addfile(info, io.BytesIO(data) if data is not None and info.isreg() else None)
    return out.getvalue()


def link(kind: bytes, target: str = "") -> Tweak:
    def tweak(info: tarfile.TarInfo) -> None:
        info.type, info.linkname, info.size = kind, target, 0
    return tweak


def fetch(root: Path, text: str, **kwargs: Any) -> Snapshot:
    return Fetcher(Store(root), chunk_size=64 << 10).ensure(granted(text, **kwargs))


def tree(snap: Snapshot) -> dict[str, bytes]:
    return {f.path: (snap.path / f.path).read_bytes() for f in snap.files}


def layer_hex(blob: bytes) -> str:
    return hashlib.sha256(blob).hexdigest()


BIG = hashlib.sha256(b"weights").digest() * 10_000  # 320 KB: several ranged requests of 64 KiB


def test_tar_layers_become_the_files_pods_see(tmp_path: Path, registry: Registry) -> None:
    weights = tar([("weights", None, None), ("weights/a.bin", BIG, None), ("./weights/sub/b.bin", b"beta", None),
                   ("weights/same.bin", None, link(tarfile.LNKTYPE, "weights/a.bin"))])
    tokenizer = gzip.compress(tar([("tok/tokenizer.json", b'{"v": 1}', None)]))
    registry.push("models/tarred:v1", {"config.json": b"{}", "weights": weights, "tok": tokenizer},
                  media_types={"weights": TAR, "tok": TGZ})
    snap = fetch(tmp_path / "root", f"oci://{registry.host}/models/tarred:v1")
    want = {"config.json": b"{}", "weights/a.bin": BIG, "weights/sub/b.bin": b"beta", "weights/same.bin": BIG,
            "tok/tokenizer.json": b'{"v": 1}'}
    assert tree(snap) == want
    for f in snap.files:  # what the pod sees: read-only regular files, each its blob, named by its own digest
        st = (snap.path / f.path).lstat()
        assert stat.S_ISREG(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o444
        assert f.sha256 == hashlib.sha256(want[f.path]).hexdigest()
    assert not (snap.path / ".weightcache").exists()
    store = Store(tmp_path / "root")
    assert not store.has_blob(layer_hex(weights)) and not store.has_blob(layer_hex(tokenizer))  # unpacked: gone
    assert {f.path: f.etag for f in snap.files}["weights/a.bin"] == layer_hex(weights)
    assert not list(store.partial_dir().glob("*.part"))
    fetcher = Fetcher(store, chunk_size=64 << 10)
    assert fetcher.ensure(granted(f"oci://{registry.host}/models/tarred:v1")).id == snap.id
    assert fetcher.stats["hits"] == 1  # the tag still names the same layers

    moved = tar([("weights", None, None), ("weights/a.bin", b"new weights", None)])
    registry.push("models/tarred:v1", {"config.json": b"{}", "weights": moved}, media_types={"weights": TAR})
    again = fetcher.ensure(granted(f"oci://{registry.host}/models/tarred:v1"))
    assert tree(again) == {"config.json": b"{}", "weights/a.bin": b"new weights"} and fetcher.stats["misses"] == 1


def test_an_oras_directory_and_globs_over_members(tmp_path: Path, registry: Registry) -> None:
    directory = gzip.compress(tar([("data", None, None), ("data/x.json", b"x", None), ("data/y.bin", b"y", None)]))
    registry.push("models/orasdir:v1", {"data": directory, "readme.md": b"hi"}, media_type=ORAS_TGZ,
                  media_types={"readme.md": "text/markdown"}, annotation="org.opencontainers.image.title",
                  modelpack=False, layer_annotations={"data": {ORAS_UNPACK: "true"}})
    text = f"oci://{registry.host}/models/orasdir:v1"
    assert tree(fetch(tmp_path / "all", text)) == {"data/x.json": b"x", "data/y.bin": b"y", "readme.md": b"hi"}
    assert tree(fetch(tmp_path / "json", text, include=["*.json"])) == {"data/x.json": b"x"}
    registry.push("models/orasdir:slash", {"./data/": directory}, media_type=ORAS_TGZ,  # a directory's own name
                  annotation="org.opencontainers.image.title", modelpack=False,
                  layer_annotations={"./data/": {ORAS_UNPACK: "true"}})
    assert tree(fetch(tmp_path / "slash", f"oci://{registry.host}/models/orasdir:slash")) == \
        {"data/x.json": b"x", "data/y.bin": b"y"}
    fetcher = Fetcher(Store(tmp_path / "md"), chunk_size=64 << 10)
    assert tree(fetcher.ensure(granted(text, include=["*.md"]))) == {"readme.md": b"hi"}  # the layer gives none
    fetcher.ensure(granted(text, include=["*.md"]))
    assert fetcher.stats["hits"] == 1  # and that layer, in the listing but in no file, is no moved tag


HOSTILE: dict[str, tuple[list[tuple[str, bytes | None, Tweak]], str]] = {
    "traversal": ([("w/../../../escaped", b"x", None)], "'..'"),
    "absolute": ([("/tmp/weightcache-escaped", b"x", None)], "absolute"),
    "symlink": ([("w/passwd", None, link(tarfile.SYMTYPE, "/etc/passwd"))], "a symlink"),
    "hard link out": ([("w/shadow", None, link(tarfile.LNKTYPE, "../etc/shadow"))], "'..'"),
    "duplicate": ([("w/a.bin", b"first", None), ("w/a.bin", b"second", None)], "named twice"),
    "device": ([("w/null", None, link(tarfile.CHRTYPE))], "character device"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_member_publishes_nothing(tmp_path: Path, registry: Registry, case: str) -> None:
    members, match = HOSTILE[case]
    repo = "models/hostile-tar-" + case.replace(" ", "-")
    registry.push(f"{repo}:v1", {"w": tar([("w", None, None), ("w/ok.bin", b"ok", None), *members])},
                  media_types={"w": TAR})
    with pytest.raises(HostileKeyError, match=match):
        fetch(tmp_path / "root", f"oci://{registry.host}/{repo}:v1")
    store = Store(tmp_path / "root")
    assert store.list() == [] and not list(store.partial_dir().glob("*.part"))
    assert not (tmp_path / "escaped").exists() and not Path("/tmp/weightcache-escaped").exists()


def test_a_truncated_gzip_layer_publishes_nothing(tmp_path: Path, registry: Registry) -> None:
    whole = gzip.compress(tar([("w", None, None), ("w/a.bin", BIG, None)]))
    registry.push("models/truncated-gzip:v1", {"w": whole[: len(whole) // 2]}, media_types={"w": TGZ})
    with pytest.raises(SourceError, match="damaged or truncated"):  # its digest is of the truncated bytes
        fetch(tmp_path / "root", f"oci://{registry.host}/models/truncated-gzip:v1")
    assert Store(tmp_path / "root").list() == []


def test_a_bit_flipped_tar_blob_is_an_integrity_failure(tmp_path: Path, registry: Registry) -> None:
    body = tar([("w", None, None), ("w/a.bin", BIG, None)])
    registry.push("models/flipped-tar:v1", {"w": body}, media_types={"w": TAR})
    blob = registry.blob_file("sha256:" + layer_hex(body))
    data = bytearray(blob.read_bytes())
    data[100_000] ^= 0x01  # inside a.bin: the tar still parses, only the digest can tell
    blob.write_bytes(bytes(data))
    with pytest.raises(IntegrityError):
        fetch(tmp_path / "root", f"oci://{registry.host}/models/flipped-tar:v1")
    assert Store(tmp_path / "root").list() == []


def test_a_damaged_layer_blob_already_in_the_store_is_not_unpacked(tmp_path: Path, registry: Registry) -> None:
    """The store keeps a blob already at a name over a new download of it (a file of several requests), so the
    bytes unpacked are hashed."""
    body = tar([("w", None, None), ("w/a.bin", BIG + b"stale", None)])  # blobs are shared across repositories
    registry.push("models/stale-blob:v1", {"w": body}, media_types={"w": TAR})
    store = Store(tmp_path / "root")
    planted = store.layout.blob(layer_hex(body))
    planted.parent.mkdir(parents=True, exist_ok=True)
    planted.write_bytes(tar([("w", None, None), ("w/a.bin", BIG[::-1] + b"stale", None)]))  # same size, other bytes
    with pytest.raises(IntegrityError, match="hashes to"):
        fetch(tmp_path / "root", f"oci://{registry.host}/models/stale-blob:v1")
    assert Store(tmp_path / "root").list() == []


def test_a_full_disk_while_unpacking_says_what_to_do(tmp_path: Path, registry: Registry,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    body = gzip.compress(tar([("w", None, None), ("w/a.bin", b"full disk", None)]))
    registry.push("models/full-disk:v1", {"w": body}, media_types={"w": TGZ})

    def full(*args: object, **kwargs: object) -> str:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(oci_tar, "sha256_of", full)  # the disk fills as the first member is written
    with pytest.raises(InsufficientSpaceError, match="free disk space"):
        fetch(tmp_path / "root", f"oci://{registry.host}/models/full-disk:v1")
    store = Store(tmp_path / "root")
    assert store.list() == [] and not list(store.partial_dir().glob("*.part"))


def gzip_bomb(members: int, size: int) -> bytes:
    """A tar+gzip layer of `members` files of `size` zero bytes in about a MiB: gzip members one after another (RFC
    1952 allows it; Python's, Go's and GNU gzip read them as one stream), the zeros compressed once."""
    zeros = gzip.compress(bytes(1 << 20), compresslevel=9)
    out = bytearray()
    for i in range(members):
        header = tarfile.TarInfo(f"w/part-{i}.bin")
        header.size = size
        out += gzip.compress(header.tobuf(tarfile.PAX_FORMAT)) + zeros * (size >> 20)
    return bytes(out + gzip.compress(bytes(2 * tarfile.BLOCKSIZE)))  # the end of the archive


def used_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


@needs_root
@pytest.mark.parametrize(("flags", "says", "most"), [
    (["--disk-budget", "128Mi"], "budget of 128 MiB", 64 << 20),  # refused before the first member is written
    ([], "keeps 64 MiB free", 448 << 20),  # the floor (64 MiB on 512 MiB): one member written, the next refused
])
def test_a_gzip_bomb_stops_at_the_disk_budget_not_at_a_full_disk(tmp_path: Path, registry: Registry,
                                                                 flags: list[str], says: str, most: int) -> None:
    """The attack: a 1 MiB tar+gzip layer of 4 x 256 MiB members, fetched with --disk-budget 128Mi onto a 512 MiB
    filesystem, filled it to 100% before failing (exit 5, "disk full"): the budget and the free-space floor were
    asked only for the layer's compressed size. Each member's room is now made before it is written."""
    registry.push("models/bomb:v1", {"w": gzip_bomb(4, 256 << 20)}, media_types={"w": TGZ})
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m", "wc-test-bomb", str(disk)], check=True)
    try:
        peak, done = [0], threading.Event()

        def watch() -> None:
            while not done.wait(0.005):
                peak[0] = max(peak[0], used_bytes(disk))
        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            run = weightcache("prefetch", f"oci://{registry.host}/models/bomb:v1", "--root", str(disk / "root"),
                              *flags, "-q", timeout=300, env={**os.environ, "DOCKER_CONFIG": str(tmp_path / "none")})
        finally:
            done.set()
            watcher.join()
        assert run.returncode == 5, run.stderr
        assert says in run.stderr and "disk full" not in run.stderr, run.stderr
        assert peak[0] < most, f"{peak[0]} bytes were written onto the 512 MiB filesystem"
        store = Store(disk / "root")
        assert store.list() == [] and os.listdir(store.layout.partial) == []
        assert used_bytes(disk) < 16 << 20
        store.close()
    finally:
        subprocess.run(["umount", str(disk)], check=True)


def test_a_category_layer_names_files_anywhere_but_never_another_layers(tmp_path: Path, registry: Registry) -> None:
    """aikit's `config` layer holds config.json and tokenizer files at their paths in the model (modctl extracts
    a tar layer relative to the model's root); a member naming a raw layer's file is refused, nothing published."""
    category = gzip.compress(tar([("config.json", b'{"c": 1}', None), ("tok/tokenizer.json", b"t", None)]))
    registry.push("models/category:v1", {"config": category, "model.bin": b"weights"},
                  media_types={"config": "application/vnd.cncf.model.weight.config.v1.tar+gzip"})
    snap = fetch(tmp_path / "a", f"oci://{registry.host}/models/category:v1")
    assert tree(snap) == {"config.json": b'{"c": 1}', "tok/tokenizer.json": b"t", "model.bin": b"weights"}
    clash = tar([("model.bin", b"other weights", None)])
    registry.push("models/category-clash:v1", {"config": clash, "model.bin": b"weights"},
                  media_types={"config": TAR})
    with pytest.raises(HostileKeyError, match=r"model\.bin"):
        fetch(tmp_path / "b", f"oci://{registry.host}/models/category-clash:v1")
    assert Store(tmp_path / "b").list() == []
