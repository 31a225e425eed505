"""Keep a live copy of every ModelCache: list (paginated), then watch from the list's resourceVersion.

    ┌─► list ?limit=N[&continue=…] ─► rv ─► watch ?resourceVersion=rv&allowWatchBookmarks=true&timeoutSeconds=T ─┐
    │        ▲                               ADDED/MODIFIED/DELETED update the copy, BOOKMARK only advances rv    │
    │        └── 410 Gone (ERROR event or HTTP 410): history compacted, relist                                   │
    └── stream ended (timeoutSeconds) ─► watch again from rv;  connection error ─► capped exponential backoff ◄──┘

The server ends each watch after `timeout_seconds`; the client's read timeout (`_request_timeout`) is the
inactivity timeout that catches a silent, half-open connection the server will never end.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import kubernetes
import urllib3
from kubernetes.client.exceptions import ApiException

from weightcache.kube import GROUP, MODELCACHES, VERSION
from weightcache.retry import DEFAULT_BACKOFF, backoff_pause

log = logging.getLogger(__name__)


_TRANSIENT = (ApiException, urllib3.exceptions.HTTPError, OSError, ValueError)


class _Expired(Exception):
    """The watch's resourceVersion is too old: only a fresh list can resume."""


class ModelCacheWatcher:
    """Background list+watch of ModelCaches; `items()` is the current set, `on_change` hears every change."""

    def __init__(
        self,
        api_client: kubernetes.client.ApiClient,
        *,
        on_change: Callable[[list[dict[str, Any]]], None] | None = None,
        timeout_seconds: int = 300,
        backoff_max: float = 30.0,
        page_size: int = 500,
        inactivity_timeout: float | None = None,
        connect_timeout: float = 10.0,
        max_cycles: int | None = None,
        lister: Callable[..., Any] | None = None,
    ) -> None:
        """`inactivity_timeout` (default timeout_seconds + 30): drop a watch that has sent nothing that long.
        `max_cycles` (tests only): stop after that many list or watch requests.
        `lister`: another collection to keep (weightcache.kube.listers): called with the list or watch
        arguments, it answers a list page as a dict; objects are keyed by namespace/name."""
        self._api = kubernetes.client.CustomObjectsApi(api_client)
        self._list = lister or functools.partial(self._api.list_cluster_custom_object, GROUP, VERSION, MODELCACHES)
        self._on_change = on_change
        self.timeout_seconds = timeout_seconds
        self.backoff_max = backoff_max
        self.page_size = page_size
        self.inactivity_timeout = inactivity_timeout if inactivity_timeout is not None else timeout_seconds + 30.0
        self.connect_timeout = connect_timeout
        self.max_cycles = max_cycles
        self.resource_version: str | None = None
        self._items: dict[str, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._synced = threading.Event()
        self._stopping = threading.Event()
        self._watch: kubernetes.watch.Watch | None = None
        self._thread: threading.Thread | None = None

    # public -----------------------------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="modelcache-watch", daemon=True)
        self._thread.start()

    def items(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._items.values())

    def wait_synced(self, timeout: float | None = None) -> bool:
        """True once the first full list has arrived (the daemon may reconcile then, not before)."""
        return self._synced.wait(timeout)

    def stop(self, timeout: float | None = 5.0) -> None:
        self._stopping.set()
        if self._thread is None:
            return
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while self._thread.is_alive() and time.monotonic() < deadline:
            # Watch.stop() can only cut a response it already has: repeat until the stream has started and ended.
            watch = self._watch
            if watch is not None:
                watch.stop()
            self._thread.join(0.05)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # loop -------------------------------------------------------------------------------------------------------
    def _run(self) -> None:
        cycles, failures = 0, 0
        while not self._stopping.is_set() and (self.max_cycles is None or cycles < self.max_cycles):
            cycles += 1
            try:
                if self.resource_version is None:
                    self._relist()
                else:
                    self._watch_once(self.resource_version)
                failures = 0
            except _Expired:
                log.info("ModelCache watch expired at resourceVersion %s; relisting", self.resource_version)
                self.resource_version = None
            except _TRANSIENT as exc:
                if self._stopping.is_set():
                    break
                if isinstance(exc, ApiException) and exc.status == 410:
                    log.info("ModelCache list/watch answered 410 Gone; relisting")
                    self.resource_version = None
                    continue
                failures += 1
                delay = backoff_pause(failures, DEFAULT_BACKOFF, cap=self.backoff_max)  # the one backoff policy
                log.warning("ModelCache watch failed (%s); retrying in %.1f s", _describe(exc), delay)
                self._stopping.wait(delay)
            except Exception:  # a bug must not kill the watch silently: log it and back off like an outage
                log.exception("ModelCache watch loop failed unexpectedly; retrying")
                self._stopping.wait(self.backoff_max)

    def _relist(self) -> None:
        items: dict[str, dict[str, Any]] = {}
        token: str | None = None
        rv = ""
        while True:
            timeouts = (self.connect_timeout, self.inactivity_timeout)
            kwargs: dict[str, Any] = {"limit": self.page_size, "_request_timeout": timeouts}
            if token:
                kwargs["_continue"] = token
            page = self._list(**kwargs)
            for obj in page.get("items") or []:
                items[_key(obj["metadata"])] = obj
            meta = page.get("metadata") or {}
            rv = rv or meta.get("resourceVersion", "")  # the first page's version is the list's snapshot
            token = meta.get("continue")
            if not token:
                break
        with self._lock:
            self._items = items
        self.resource_version = rv
        log.info("listed %d ModelCaches at resourceVersion %s", len(items), rv)
        self._synced.set()
        self._notify()

    def _watch_once(self, rv: str) -> None:
        watch = kubernetes.watch.Watch()
        self._watch = watch
        try:
            for event in watch.stream(
                self._list,
                resource_version=rv,
                allow_watch_bookmarks=True,
                timeout_seconds=self.timeout_seconds,
                _request_timeout=(self.connect_timeout, self.inactivity_timeout),
            ):
                self._apply(event)
                if self._stopping.is_set():
                    break
        finally:
            self._watch = None

    def _apply(self, event: dict[str, Any]) -> None:
        kind, obj = event.get("type"), event.get("raw_object") or event.get("object") or {}
        if kind == "ERROR":  # the client raises for these when timeoutSeconds is set; kept for safety
            if obj.get("code") == 410:
                raise _Expired()
            raise ApiException(status=obj.get("code") or 500, reason=obj.get("message") or "watch error")
        meta = obj.get("metadata") or {}
        if meta.get("resourceVersion"):
            self.resource_version = meta["resourceVersion"]
        if kind == "BOOKMARK":
            return
        name = meta.get("name")
        if not name:
            return
        key = _key(meta)
        with self._lock:
            if kind == "DELETED":
                self._items.pop(key, None)
            elif kind in ("ADDED", "MODIFIED"):
                self._items[key] = obj
            else:
                return
        log.debug("ModelCache %s %s (resourceVersion %s)", name, kind, self.resource_version)
        self._notify()

    def _notify(self) -> None:
        if self._on_change is None:
            return
        try:
            self._on_change(self.items())
        except Exception:  # the caller's bug must not stop the watch
            log.exception("ModelCache on_change callback failed")


def _key(meta: dict[str, Any]) -> str:
    """Cluster-scoped objects by name, namespaced ones by namespace/name (two pods may share a name)."""
    return f"{meta['namespace']}/{meta['name']}" if meta.get("namespace") else str(meta["name"])


def _describe(exc: BaseException) -> str:
    """A short, credential-free description (ApiException's str() includes response headers)."""
    if isinstance(exc, ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return type(exc).__name__
