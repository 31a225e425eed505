"""Tar layers of OCI artifacts unpacked safely (weightcache/sources/oci_tar.py): a good tar and a gzip one unpack
to their files, members named as packers name them; hostile tars (links out, hard links across, devices, FIFOs,
traversal, absolute names, the store's own name, twice, file under file, member and byte bounds, a pax header
bomb, truncation) are refused with nothing but the members before the bad one passed to `write`."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from collections.abc import Callable

import pytest

from weightcache.errors import HostileKeyError, SourceError
from weightcache.sources.oci_tar import TarLimits, Unpacked, sha256_of, unpack_layer


def tar(members: list[tuple[str, bytes | None, Callable[[tarfile.TarInfo], None] | None]],
        fmt: int = tarfile.PAX_FORMAT) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=fmt) as tf:
        for name, data, tweak in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
            else:
                info.size = len(data)
            if tweak is not None:
                tweak(info)
            tf.addfile(info, io.BytesIO(data) if data is not None and info.isreg() else None)
    return out.getvalue()


class Sink:
    def __init__(self) -> None:
        self.written: dict[str, bytes] = {}

    def __call__(self, relpath: str, size: int, read: Callable[[int], bytes]) -> str:
        buf = bytearray()
        sha = sha256_of(read, size, buf.extend)
        self.written[relpath] = bytes(buf)
        return sha


def test_a_tar_and_a_gzip_tar_unpack_to_their_files() -> None:
    body = tar([("weights", None, None), ("weights/a.bin", b"alpha", None), ("./weights/sub/b.bin", b"beta", None),
                ("weights/c.bin", b"", _kind(tarfile.LNKTYPE, "weights/a.bin"))])
    for compression, blob in (("tar", body), ("tar+gzip", gzip.compress(body))):
        sink = Sink()
        got = unpack_layer(io.BytesIO(blob), "weights", compression, sink)
        sha = hashlib.sha256(b"alpha").hexdigest()
        assert got == [Unpacked("weights/a.bin", 5, sha), Unpacked("weights/c.bin", 5, sha),
                       Unpacked("weights/sub/b.bin", 4, hashlib.sha256(b"beta").hexdigest())]
        assert sink.written == {"weights/a.bin": b"alpha", "weights/sub/b.bin": b"beta"}  # the link: no copy
    single = tar([("config.json", b"{}", None)])  # ModelPack: one file per tar layer, named by its filepath
    assert [u.relpath for u in unpack_layer(io.BytesIO(single), "config.json", "tar", Sink())] == ["config.json"]


def test_members_named_as_packers_name_them() -> None:
    """modctl extracts a tar layer's members relative to the model's root (a category layer "config" holds
    config.json and tok/t.json); aikit and modctl's earlier archiver pack a nested file by its basename, which the
    annotation places; `tar -C model .` names the root ./ and every member ./..."""
    category = tar([("config.json", b"{}", None), ("tok/t.json", b"t", None)])
    assert [u.relpath for u in unpack_layer(io.BytesIO(category), "config", "tar", Sink())] == \
        ["config.json", "tok/t.json"]
    nested = tar([("model.safetensors", b"w", None)])
    assert [u.relpath for u in unpack_layer(io.BytesIO(nested), "sub/dir/model.safetensors", "tar", Sink())] == \
        ["sub/dir/model.safetensors"]
    rooted = tar([("./", None, None), ("./w", None, None), ("./w/a.bin", b"a", None)])
    assert [u.relpath for u in unpack_layer(io.BytesIO(rooted), "w", "tar", Sink())] == ["w/a.bin"]


def _kind(kind: bytes, link: str = "") -> Callable[[tarfile.TarInfo], None]:
    def tweak(info: tarfile.TarInfo) -> None:
        info.type, info.linkname, info.size = kind, link, 0
    return tweak


HOSTILE: dict[str, tuple[list[tuple[str, bytes | None, Callable[[tarfile.TarInfo], None] | None]], str]] = {
    "symlink out": ([("w/evil", b"", _kind(tarfile.SYMTYPE, "/etc/passwd"))], "a symlink"),
    "symlink inside": ([("w/a", b"x", None), ("w/b", b"", _kind(tarfile.SYMTYPE, "a"))], "a symlink"),
    "hard link out": ([("w/evil", b"", _kind(tarfile.LNKTYPE, "/etc/shadow"))], "absolute"),
    "hard link to another layer": ([("w/evil", b"", _kind(tarfile.LNKTYPE, "other/x.bin"))], "hard link"),
    "hard link to a later member": ([("w/a", b"", _kind(tarfile.LNKTYPE, "w/b")), ("w/b", b"x", None)], "hard link"),
    "character device": ([("w/null", b"", _kind(tarfile.CHRTYPE))], "character device"),
    "block device": ([("w/sda", b"", _kind(tarfile.BLKTYPE))], "block device"),
    "fifo": ([("w/pipe", b"", _kind(tarfile.FIFOTYPE))], "FIFO"),
    "traversal": ([("w/../../etc/cron.d/x", b"x", None)], "'..'"),
    "absolute": ([("/etc/passwd", b"x", None)], "passwd"),
    "the store's own name": ([(".weightcache/layers/" + "0" * 64, b"x", None)], "'.weightcache'"),
    "a tar's root then traversal": ([("./", None, None), ("./../x", b"x", None)], "'..'"),
    "twice": ([("w/a", b"x", None), ("w/a", b"y", None)], "named twice"),
    "file under a file": ([("w/a", b"x", None), ("w/a/b", b"y", None)], "a file and a directory"),
    "file then a directory above it": ([("w/a/b", b"x", None), ("w/a", b"y", None)], "a file and a directory"),
    "directory that is a file": ([("w/a", b"x", None), ("w/a", None, None)], "a file and a directory"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_tar_is_refused(case: str) -> None:
    members, match = HOSTILE[case]
    sink = Sink()
    with pytest.raises(HostileKeyError, match=match):
        unpack_layer(io.BytesIO(tar(members)), "w", "tar", sink)
    assert all(not p.startswith(("/", "..")) and ".." not in p.split("/") for p in sink.written)


def test_bounds_on_members_bytes_and_headers() -> None:
    many = tar([(f"w/f{i}", b"x", None) for i in range(11)])
    with pytest.raises(HostileKeyError, match="more than 10 members"):
        unpack_layer(io.BytesIO(many), "w", "tar", Sink(), TarLimits(max_members=10))
    big = tar([("w/a", b"x" * 1000, None), ("w/b", b"y" * 1000, None)])
    sink = Sink()
    with pytest.raises(HostileKeyError, match="more than 1500 bytes"):
        unpack_layer(io.BytesIO(big), "w", "tar", sink, TarLimits(max_bytes=1500))
    assert list(sink.written) == ["w/a"]
    bomb = tar([("w/" + "n" * 200_000, b"x", None)])  # a pax header of ~200 KB for one long name
    with pytest.raises(HostileKeyError, match="extended tar header"):
        unpack_layer(io.BytesIO(bomb), "w", "tar", Sink())
    gzip_bomb = gzip.compress(tar([("w/zeros", bytes(1 << 20), None)]))  # 1 MiB of zeros, ~1 KB compressed
    with pytest.raises(HostileKeyError, match="more than"):
        unpack_layer(io.BytesIO(gzip_bomb), "w", "tar+gzip", Sink(), TarLimits(max_bytes=64 << 10))


def test_a_damaged_tar_or_an_unknown_compression_is_a_source_error() -> None:
    body = tar([("w/a", b"x" * 5000, None)])
    with pytest.raises(SourceError, match=r"damaged or truncated|short"):
        unpack_layer(io.BytesIO(body[:1500]), "w", "tar", Sink())
    with pytest.raises(SourceError, match="damaged or truncated"):
        unpack_layer(io.BytesIO(b"not gzip at all" * 40), "w", "tar+gzip", Sink())
    with pytest.raises(SourceError, match="tar\\+zstd"):
        unpack_layer(io.BytesIO(body), "w", "tar+zstd", Sink())
