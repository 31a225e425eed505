"""`Store.changes`: the one "has the store changed" token (weightcache/store/changes.py) that the API's listing and
the DRA slice publisher redo their work by. It must move on every change either of them shows, whoever made it,
and stand still otherwise (else the listing re-reads the whole index on every request)."""

from __future__ import annotations

from pathlib import Path

from tests.fixtures_store import fetch, make_models
from weightcache.store import Store


def test_the_token_moves_on_each_change_and_stands_still_between(tmp_path: Path) -> None:
    models = make_models(tmp_path / "src", "a", "b")
    store = Store(tmp_path / "root")
    try:
        seen = [store.changes.read()[0]]

        def moved() -> bool:
            token = store.changes.read()[0]
            new = token != seen[-1]
            seen.append(token)
            return new

        assert not moved(), "nothing changed"
        snap = fetch(store, models["a"])
        assert moved(), "a publish"
        store.lease("pod-1", snap.id)
        assert moved(), "a lease"
        store.pin(snap.id)
        assert moved(), "a pin"
        store.unpin(snap.id)
        store.release("pod-1")
        assert moved(), "an unpin and a release"
        other = Store(tmp_path / "root")  # another process's store (a CLI): its commits count as well
        try:
            fetch(other, models["b"])
        finally:
            other.close()
        assert moved(), "a publish through another connection"
        store.evict(snap.id)
        assert moved(), "an eviction"
        assert not moved()
    finally:
        store.close()
