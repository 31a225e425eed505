"""ModelCacheWatcher against the fake API server: list, watch, bookmarks, 410, drops, inactivity, backoff."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer, model_cache, node
from weightcache.kube.watch import ModelCacheWatcher

MC_PATH = "/apis/weightcache.io/v1alpha1/modelcaches"


class Changes:
    """on_change recorder that tests can wait on."""

    def __init__(self) -> None:
        self.calls: list[list[dict[str, Any]]] = []
        self._cond = threading.Condition()

    def __call__(self, items: list[dict[str, Any]]) -> None:
        with self._cond:
            self.calls.append(items)
            self._cond.notify_all()

    def wait(self, pred: Callable[[set[str]], bool], timeout: float = 10.0) -> set[str]:
        def names() -> set[str]:
            return {o["metadata"]["name"] for o in self.calls[-1]} if self.calls else set()

        with self._cond:
            assert self._cond.wait_for(lambda: pred(names()), timeout), f"last names: {names()}"
            return names()


@pytest.fixture
def server(apiserver: FakeApiServer) -> FakeApiServer:
    return apiserver


@pytest.fixture
def watch(server: FakeApiServer) -> Iterator[Callable[..., tuple[ModelCacheWatcher, Changes]]]:
    started: list[ModelCacheWatcher] = []

    def make(**kwargs: Any) -> tuple[ModelCacheWatcher, Changes]:
        changes = Changes()
        watcher = ModelCacheWatcher(server.api_client(), on_change=changes, backoff_max=0.05, **kwargs)
        watcher.start()
        started.append(watcher)
        return watcher, changes

    yield make
    for w in started:
        w.stop()
        assert not w.running


def full_lists(server: FakeApiServer) -> int:
    """How many full lists the server answered: a LIST's first page (a watch or a later page is not one)."""
    return sum(1 for r in server.requests_matching("GET", MC_PATH) if "watch" not in r.query
               and "continue" not in r.query)


def until(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    """Poll a condition that has no event to wait on; fail after `timeout`."""
    done = threading.Event()
    deadline = threading.Timer(timeout, done.set)
    deadline.start()
    try:
        while not pred():
            assert not done.wait(0.01), "condition not met in time"
    finally:
        deadline.cancel()


def _mc(name: str) -> dict[str, Any]:
    return model_cache(name, f"s3://models/{name}/", node_selector={"gpu": "h100"})


def test_initial_list_is_paginated_then_watch_starts_from_its_version(server, watch):
    for i in range(5):
        server.create("modelcaches", _mc(f"m{i}"))
    list_rv = str(server.resource_version)
    watcher, _ = watch(page_size=2)
    assert watcher.wait_synced(10)
    assert {o["metadata"]["name"] for o in watcher.items()} == {f"m{i}" for i in range(5)}
    pages = server.requests_matching("GET", MC_PATH)
    lists = [r for r in pages if "watch" not in r.query]
    assert [r.query.get("limit") for r in lists] == ["2", "2", "2"]
    assert "continue" not in lists[0].query and lists[1].query["continue"] and lists[2].query["continue"]
    (w,) = server.wait_requests("GET", MC_PATH, watch="True")
    assert w.query["resourceVersion"] == list_rv
    assert w.query["allowWatchBookmarks"] == "True"
    assert w.query["timeoutSeconds"] == "300"


def test_added_modified_deleted_follow_the_server(server, watch):
    server.create("modelcaches", _mc("a"))
    watcher, changes = watch()
    assert watcher.wait_synced(10)
    server.wait_requests("GET", MC_PATH, watch="True")
    server.create("modelcaches", _mc("b"))
    changes.wait(lambda n: n == {"a", "b"})
    current = server.get("modelcaches", "b")
    current["spec"]["tier"] = "memory"
    server.update("modelcaches", "b", current)
    changes.wait(lambda n: any(o["spec"].get("tier") == "memory" for o in watcher.items()))
    server.delete("modelcaches", "a")
    assert changes.wait(lambda n: n == {"b"}) == {"b"}
    assert watcher.resource_version == str(server.resource_version)
    assert full_lists(server) == 1


def test_bookmark_advances_resource_version_so_a_reconnect_needs_no_relist(server, watch):
    server.create("modelcaches", _mc("a"))
    watcher, _ = watch()
    assert watcher.wait_synced(10)
    server.wait_requests("GET", MC_PATH, watch="True")
    server.create("nodes", node("n1"))  # other kinds move the global resourceVersion past ours
    server.create("nodes", node("n2"))
    target = str(server.resource_version)
    assert watcher.resource_version != target
    server.send_bookmark()
    until(lambda: watcher.resource_version == target)  # the bookmark carries only a version
    server.expire_before(int(target))  # history before the bookmark is gone; resuming at it still works
    server.drop_watches()
    again = server.wait_requests("GET", MC_PATH, count=2, watch="True")
    assert again[1].query["resourceVersion"] == target
    assert full_lists(server) == 1
    assert [o["metadata"]["name"] for o in watcher.items()] == ["a"]


def test_expired_resource_version_relists(server, watch):
    server.create("modelcaches", _mc("a"))
    watcher, changes = watch()
    assert watcher.wait_synced(10)
    server.wait_requests("GET", MC_PATH, watch="True")
    server.delete("modelcaches", "a")
    changes.wait(lambda n: n == set())
    server.hang_watches = True  # the next change must arrive only through the relist
    server.create("modelcaches", _mc("b"))
    stale = watcher.resource_version
    server.expire_before(server.resource_version + 1)
    server.drop_watches()
    server.hang_watches = False
    changes.wait(lambda n: n == {"b"})
    assert full_lists(server) >= 2  # relisted; a watch dropped again before the new one was up may relist once more
    watches = server.wait_requests("GET", MC_PATH, count=3, watch="True")
    assert watches[1].query["resourceVersion"] == stale  # answered with ERROR 410 Expired
    assert int(watches[2].query["resourceVersion"]) == server.resource_version  # from the relist


def test_dropped_connection_reconnects_from_last_version(server, watch):
    watcher, changes = watch()
    assert watcher.wait_synced(10)
    (first,) = server.wait_requests("GET", MC_PATH, watch="True")
    server.drop_watches()
    second = server.wait_requests("GET", MC_PATH, count=2, watch="True")[1]
    assert second.query["resourceVersion"] == first.query["resourceVersion"]
    server.create("modelcaches", _mc("late"))
    changes.wait(lambda n: n == {"late"})
    assert full_lists(server) == 1


def test_silent_connection_is_dropped_by_the_inactivity_timeout(server, watch):
    server.hang_watches = True  # accepts the watch, then never sends a byte nor ends it
    watcher, changes = watch(inactivity_timeout=0.3)
    assert watcher.wait_synced(10)
    server.wait_requests("GET", MC_PATH, count=2, watch="True", timeout=10)
    server.hang_watches = False
    server.create("modelcaches", _mc("x"))
    changes.wait(lambda n: n == {"x"})


def test_server_timeout_ends_the_stream_and_the_watch_resumes(server, watch):
    watcher, _ = watch(timeout_seconds=1)
    assert watcher.wait_synced(10)
    watches = server.wait_requests("GET", MC_PATH, count=2, watch="True", timeout=10)
    assert watches[1].query["resourceVersion"] == watches[0].query["resourceVersion"]
    assert full_lists(server) == 1


def test_api_errors_back_off_and_recover(server, watch):
    server.fail_requests = 3
    server.create("modelcaches", _mc("a"))
    watcher, _ = watch()
    assert watcher.wait_synced(10)
    assert len([r for r in server.requests_matching("GET", MC_PATH) if "watch" not in r.query]) == 4
    assert [o["metadata"]["name"] for o in watcher.items()] == ["a"]


def test_unreachable_server_is_retried_until_stopped(server):
    client = server.api_client()
    server.stop()
    watcher = ModelCacheWatcher(client, backoff_max=0.05, connect_timeout=0.5)
    watcher.start()
    assert not watcher.wait_synced(0.5)
    watcher.stop()
    assert not watcher.running


def test_max_cycles_bounds_the_loop(server):
    watcher = ModelCacheWatcher(server.api_client(), max_cycles=1)
    watcher.start()
    assert watcher.wait_synced(10)
    watcher.stop()
    assert not watcher.running
    assert server.requests_matching("GET", MC_PATH, watch="True") == []


def test_stop_interrupts_an_open_watch_promptly(server, watch):
    watcher, _ = watch()
    assert watcher.wait_synced(10)
    server.wait_requests("GET", MC_PATH, watch="True")
    watcher.stop(timeout=3)
    assert not watcher.running
