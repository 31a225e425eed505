"""A download journal under partial/ is data from disk: a damaged one restarts its file, never crashes the fetch,
never resumes bytes the part file does not hold, and a planted symlink in its place is dropped, not followed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from weightcache.download import PartialFile
from weightcache.sources.base import ObjectInfo

SIZE = 1 << 20
OBJ = ObjectInfo("bucket/m/w.bin", "w.bin", SIZE, "etag-1", None, None)
HEADER = json.dumps({"key": OBJ.key, "size": OBJ.size, "etag": OBJ.etag, "version_id": OBJ.version_id})


def opened(part: Path) -> list[tuple[int, int]]:
    pf = PartialFile(part, OBJ, range_size=SIZE)
    try:
        return pf.open()
    finally:
        pf.close()


def test_a_good_journal_resumes(tmp_path: Path) -> None:
    part = tmp_path / "x.part"
    part.write_bytes(b"\0" * SIZE)
    part.with_suffix(".journal").write_text(f"{HEADER}\n0 4096\n")
    assert opened(part) == [(4096, SIZE - 4096)]


@pytest.mark.parametrize("journal", [
    b"\xff\xfe not utf-8", b"[" * 100_000, b"", b"{}\n0 4096\n",
    f"{HEADER}\n\u0661 4096\n".encode(),  # an Arabic-Indic digit: isdigit() but not a journal number
])
def test_a_damaged_journal_restarts_the_file(tmp_path: Path, journal: bytes) -> None:
    part = tmp_path / "x.part"
    part.write_bytes(b"\0" * SIZE)
    part.with_suffix(".journal").write_bytes(journal)
    assert opened(part) == [(0, SIZE)]


def test_a_part_file_shorter_than_the_object_is_not_resumed(tmp_path: Path) -> None:
    part = tmp_path / "x.part"
    part.write_bytes(b"\0" * 100)  # truncated behind our back: the journalled range is not on disk
    part.with_suffix(".journal").write_text(f"{HEADER}\n0 4096\n")
    assert opened(part) == [(0, SIZE)]
    assert part.stat().st_size == SIZE


@pytest.mark.parametrize("which", ["part", "journal"])
def test_planted_part_or_journal_symlink_is_dropped(tmp_path: Path, which: str) -> None:
    outside = tmp_path / "outside"
    outside.write_bytes(b"precious")
    part = tmp_path / "x.part"
    (part if which == "part" else part.with_suffix(".journal")).symlink_to(outside)
    assert opened(part) == [(0, SIZE)]
    assert outside.read_bytes() == b"precious"
    assert not part.is_symlink() and not part.with_suffix(".journal").is_symlink()
