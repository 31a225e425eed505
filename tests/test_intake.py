"""weightcache/intake.py on a real store: room made as bytes arrive (ahead in steps, never refusing a writer that
fits for the step, evicting only what the writer may evict), and the one hostile-tar reader both tar writers use."""

from __future__ import annotations

import gzip
import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from weightcache import intake
from weightcache.errors import InsufficientSpaceError
from weightcache.store import FileEntry, Snapshot, Store
from weightcache.uri import parse_ref

MiB = 1 << 20


def cached(store: Store, name: str, size: int) -> Snapshot:
    data = hashlib.sha256(name.encode()).digest() * (size // 32)
    part = store.partial_path(name)
    part.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    store.add_blob(part, sha)
    return store.publish(parse_ref(f"s3://models/{name}/"), [FileEntry("w.bin", len(data), sha)])


def test_a_writer_that_fits_is_not_refused_for_the_step(tmp_path: Path) -> None:
    store = Store(tmp_path / "root", budget_bytes=100 * MiB, min_free_bytes=0, min_free_percent=0)
    room = intake.Room(store, uri="test://writer")
    room.take(60 * MiB)  # 60 + the 64 MiB step passes the budget: room for exactly 60
    assert room.reserved == 60 * MiB
    room.take(40 * MiB)  # exactly the budget
    with pytest.raises(InsufficientSpaceError, match="budget"):
        room.take(1)


def test_room_evicts_only_what_the_writer_may(tmp_path: Path) -> None:
    store = Store(tmp_path / "root", budget_bytes=8 * MiB, min_free_bytes=0, min_free_percent=0)
    model, cache = cached(store, "model", 4 * MiB), cached(store, "cache", 3 * MiB)
    room = intake.Room(store, uri="test://cache", evictable=lambda s: s.id == cache.id)
    room.take(4 * MiB)  # 7 MiB used: the cache goes, the model stays
    assert [i.snapshot.id for i in store.list()] == [model.id]
    with pytest.raises(InsufficientSpaceError):
        room.take(1 * MiB)
    assert [i.snapshot.id for i in store.list()] == [model.id]


def test_the_budget_hook_is_asked_first(tmp_path: Path) -> None:
    asked: list[int] = []

    def budget(total: int) -> None:
        asked.append(total)
        if total > 10 * MiB:
            raise InsufficientSpaceError("over the writer's own budget")

    room = intake.Room(Store(tmp_path / "root"), uri="test://w", budget=budget)
    room.take(MiB)
    with pytest.raises(InsufficientSpaceError, match="own budget"):
        room.take(20 * MiB)
    # each time: ahead by the 64 MiB step first, then for exactly what is written
    assert asked == [65 * MiB, 1 * MiB, 85 * MiB, 21 * MiB]


def _tar(kind: bytes, size: int = 0, name: str = "x") -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tf:
        info = tarfile.TarInfo(name)
        info.type, info.size, info.linkname = kind, size, "target" if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE) else ""
        tf.addfile(info, io.BytesIO(bytes(size)) if kind == tarfile.REGTYPE else None)
    return out.getvalue()


def _names(blob: bytes, **kwargs: object) -> list[str]:
    with intake.reading(io.BytesIO(blob), **kwargs) as tf:  # type: ignore[arg-type]
        return [m.name for m in tf]


@pytest.mark.parametrize(("blob", "hard_links", "why"), [
    (_tar(tarfile.SYMTYPE), True, "a symlink"),
    (_tar(tarfile.LNKTYPE), False, "a hard link"),
    (_tar(tarfile.CHRTYPE), True, "a character device"),
    (_tar(tarfile.FIFOTYPE), True, "a FIFO"),
    (_tar(tarfile.REGTYPE, name="p" * 70_000), True, "extended tar header"),
])
def test_the_reader_refuses_by_the_header(blob: bytes, hard_links: bool, why: str) -> None:
    with pytest.raises(intake.TarRefused, match=why):
        _names(blob, hard_links=hard_links)


def test_a_hard_link_passes_where_the_caller_takes_them_and_damage_is_damage() -> None:
    assert _names(_tar(tarfile.LNKTYPE), hard_links=True) == ["x"]
    for damaged in (_tar(tarfile.REGTYPE, 4096)[:1000], b"not a tar at all" * 64, gzip.compress(b"x")[:-4]):
        with pytest.raises(intake.TarDamaged):
            raw = gzip.GzipFile(fileobj=io.BytesIO(damaged)) if damaged.startswith(b"\x1f\x8b") else io.BytesIO(damaged)
            with intake.reading(raw) as tf:  # type: ignore[arg-type]
                for member in tf:
                    data = tf.extractfile(member)
                    assert data is not None
                    data.read()
