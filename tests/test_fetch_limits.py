"""Limits a hostile listing meets at plan time, before any byte is fetched: each names the key and exits 2."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fsspec
import pytest

import weightcache.store.paths as paths
from tests.grants import granted
from weightcache.cli import main
from weightcache.errors import HostileKeyError, answer_for
from weightcache.fetch import Fetcher
from weightcache.store import Store


@pytest.fixture
def memfs() -> Iterator[Any]:
    fs = fsspec.filesystem("memory")
    yield fs
    if fs.exists("/lim"):
        fs.rm("/lim", recursive=True)


@pytest.mark.parametrize(("key", "problem"), [
    ("d/" * 1500 + "f", "more than 64 directories deep"),
    ("/".join(["p" * 200] * 17), "path longer than 3072 bytes"),
    ("n" * 256, "a name is longer than 255 bytes"),
])
def test_limits_are_checked_before_any_download(tmp_path: Path, memfs: Any, key: str, problem: str) -> None:
    memfs.pipe("/lim/m/config.json", b"{}")
    memfs.pipe(f"/lim/m/{key}", b"x")
    store = Store(tmp_path / "root")
    with pytest.raises(HostileKeyError, match=problem) as info:
        Fetcher(store).ensure(granted("memory://lim/m/"))
    assert info.value.key == key and answer_for(info.value).exit_code == 2
    assert store.list() == [] and not list(store.layout.partial.glob("*.part"))


def test_too_many_files_are_refused_naming_the_limit(tmp_path: Path, memfs: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(paths, "MAX_FILES", 10)
    for i in range(11):
        memfs.pipe(f"/lim/m/f{i:02d}", b"x")
    with pytest.raises(HostileKeyError, match="11 files, more than 10"):
        Fetcher(Store(tmp_path / "root")).ensure(granted("memory://lim/m/"))


def test_the_cli_exits_2_for_a_deep_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    deep = tmp_path / "src" / "a"
    deep.mkdir(parents=True)
    (deep / "config.json").write_bytes(b"{}")
    nested = deep
    for _ in range(70):  # 70 levels fit in PATH_MAX on disk, and exceed MAX_DEPTH
        nested = nested / "d"
    nested.mkdir(parents=True)
    (nested / "w.bin").write_bytes(b"x")
    code = main(["prefetch", "--no-daemon", f"file://{deep}/", "--root", str(tmp_path / "root")])
    assert code == 2
    assert "directories deep" in capsys.readouterr().err
