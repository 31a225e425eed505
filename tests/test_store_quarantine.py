"""quarantine/ is bounded: entries past their age or past the size bound (oldest first) go at store start and with
gc; what is left is counted (metrics) without following a link planted inside an entry."""

from __future__ import annotations

import os
import time
from pathlib import Path

from weightcache.store import Store, collect_garbage, quarantine_usage
from weightcache.store import quarantine as q


def _plant(store: Store, name: str, size: int, age_s: float) -> None:
    """A record with `size` bytes, quarantined `age_s` ago as the store does it (then back-dated)."""
    path = store.layout.manifests / name
    path.write_bytes(b"x" * size)
    store.tree.quarantine(path, "is a test entry")
    [moved] = [e for e in os.listdir(store.layout.quarantine) if e.startswith(f"manifests%2F{name}.")]
    stamp = int(moved.rpartition(".")[2]) - int(age_s * 1e9)
    os.rename(store.layout.quarantine / moved, store.layout.quarantine / f"manifests%2F{name}.{stamp}")


def _names(store: Store) -> list[str]:
    return sorted(e.name.rpartition(".")[0].rpartition("%2F")[2] for e in q.entries(store))


def test_old_entries_go_and_young_ones_stay_with_a_count(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    _plant(store, "old", 100, q.QUARANTINE_MAX_AGE_S + 60)
    _plant(store, "young", 10, 60)
    assert quarantine_usage(store) == q.QuarantineUsage(entries=2, bytes=110)
    assert collect_garbage(store) >= 100
    assert _names(store) == ["young"]
    assert quarantine_usage(store) == q.QuarantineUsage(entries=1, bytes=10)


def test_past_the_size_bound_the_oldest_go_first(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    for i, name in enumerate(["a", "b", "c", "d"]):
        _plant(store, name, 1000, 400 - 100 * i)  # a is the oldest
    assert q.prune(store, max_bytes=2500) == 2000
    assert _names(store) == ["c", "d"]
    assert q.prune(store, max_bytes=2500) == 0  # within bound: nothing more


def test_store_start_prunes_before_anything_else(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    _plant(store, "old", 100, q.QUARANTINE_MAX_AGE_S + 60)
    _plant(store, "young", 100, 0)
    store.close()
    reopened = Store(tmp_path / "store")
    assert _names(reopened) == ["young"]


def test_a_link_inside_an_entry_is_counted_as_a_link_and_never_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "big").write_bytes(b"y" * 50_000)
    store = Store(tmp_path / "store")
    planted = store.layout.root / "snapshots" / "deep"
    (planted / "a" / "b").mkdir(parents=True)
    (planted / "a" / "b" / "f").write_bytes(b"z" * 7)
    (planted / "a" / "link").symlink_to(outside)
    (planted / "a" / "b" / "file-link").symlink_to(outside / "big")
    store.tree.quarantine(planted, "is a test tree")
    usage = quarantine_usage(store)
    assert usage.entries == 1 and 7 <= usage.bytes < 1000
    assert q.prune(store, max_bytes=0) == usage.bytes
    assert quarantine_usage(store) == q.QuarantineUsage(0, 0)
    assert (outside / "big").stat().st_size == 50_000  # what the link pointed at is untouched


def test_a_name_without_a_stamp_ages_by_its_mtime(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    stray = store.layout.quarantine / "left-by-hand"
    stray.write_bytes(b"s" * 5)
    old = time.time() - q.QUARANTINE_MAX_AGE_S - 60
    os.utime(stray, (old, old))
    assert q.prune(store) == 5 and not stray.exists()


def test_a_stamp_of_other_digits_ages_by_its_mtime(tmp_path: Path) -> None:
    """'٣'.isdigit() is True and int() reads it: a planted name's "stamp" of such digits is no stamp."""
    store = Store(tmp_path / "store")
    stray = store.layout.quarantine / ("planted." + "\u0663" * 19)
    stray.write_bytes(b"s" * 5)
    old = time.time() - q.QUARANTINE_MAX_AGE_S - 60
    os.utime(stray, (old, old))
    assert q.prune(store) == 5 and not stray.exists()
