"""The reconcile loop: desired models (config keep-warm list + ModelCaches selecting this node) -> the store.

Level-triggered. A pass never waits for a download:
    look up every wanted model; start a fetch task for each one missing        I/O (fetches: parallelModels
        (highest priority first; a finished fetch wakes the loop again)          at a time, in the background)
    settle(held, wants, cached, actual) -> Outcome: pin/unpin, promote/demote,  pure: tested on plain data,
        node labels to set/remove, ModelCache statuses to forget               500 models in milliseconds
The daemon pins as owner "daemon", so what it pinned is read back from the store: a ModelCache deleted while
the daemon was down is still unpinned, and a pin someone made by hand is never taken away.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from weightcache import hf_layout
from weightcache.access import ADMIN, Grant
from weightcache.csi import adapters
from weightcache.csi.reconcile import VolumeBook
from weightcache.daemon import startup_taint
from weightcache.daemon.config import ModelSpec
from weightcache.daemon.node import Node, Want
from weightcache.errors import NotAllowedError, SignatureError
from weightcache.fetch import Progress
from weightcache.store import Snapshot, Store, StreamViews
from weightcache.uri import is_readiness_label
from weightcache.vocabulary import READINESS_LABEL_PREFIX, READY

log = logging.getLogger(__name__)

PIN_OWNER = "daemon"  # the store keeps one pin per owner: a pin someone made by hand is never taken away


@dataclass(frozen=True)
class Held:
    """What the daemon did for a want last time: the snapshot it resolved to, and whether it pinned it."""

    snapshot: str
    pinned: bool
    tier: str
    label_key: str


@dataclass(frozen=True)
class Actual:
    """The world as it is now, read before settling."""

    pinned: frozenset[str] = frozenset()  # snapshots carrying the daemon's pin (owner PIN_OWNER)
    resident: frozenset[str] = frozenset()  # snapshots in the memory tier
    labels: Mapping[str, str] | None = None  # node labels; None off-cluster (no labels to keep)
    stored: frozenset[str] = frozenset()  # readiness label keys of the selections the store holds a snapshot of


@dataclass(frozen=True)
class Outcome:
    held: dict[str, Held]
    pin: frozenset[str]
    unpin: frozenset[str]
    promote: frozenset[str]
    demote: frozenset[str]
    labels: dict[str, str | None]  # node label changes: "ready", or None to remove
    forget: tuple[str, ...]  # ModelCache names no longer wanted here


def wants(config_models: Iterable[ModelSpec], selected: Iterable[Want]) -> list[Want]:
    """Config models + the ModelCaches selecting this node, highest priority first, then by name."""
    out = [Want(m.name, m.ref, m.tier, m.pin) for m in config_models] + list(selected)
    return sorted(out, key=lambda w: (-w.priority, w.name))


def settle(old: Mapping[str, Held], wanted: Sequence[Want], results: Mapping[str, str], actual: Actual) -> Outcome:
    """Pure: the actions that take the node from `actual` to `wanted`, given this pass's ensure `results`.

    Pins and labels are level-triggered against `actual` (what the daemon pinned or labelled and no longer
    wants is undone, even across restarts); a want whose ensure failed keeps what it held last pass.
    """
    held: dict[str, Held] = {}
    for w in wanted:
        if w.name in results:
            held[w.name] = Held(results[w.name], w.pin, w.tier, w.ref.label_key)
        elif w.name in old:
            held[w.name] = old[w.name]
    pinned = _ids(held, lambda h: h.pinned)
    memory_old, memory_new = _ids(old, lambda h: h.tier == "memory"), _ids(held, lambda h: h.tier == "memory")
    return Outcome(
        held=held,
        pin=frozenset(pinned - actual.pinned),
        unpin=frozenset(actual.pinned - pinned),
        promote=frozenset(memory_new - actual.resident),
        demote=frozenset((memory_old - memory_new) & actual.resident),
        labels=_label_changes({h.label_key for h in held.values()}, actual.labels, actual.stored),
        forget=tuple(sorted(n for n in old if n not in held and not n.startswith("config/"))),
    )


def _label_changes(ready: set[str], labels: Mapping[str, str] | None,
                   stored: frozenset[str] = frozenset()) -> dict[str, str | None]:
    """Wanted and held: set `ready`. No longer wanted: a `ready` label stays while the store still holds a
    snapshot of that selection (scale from zero then needs no gate round trip), and goes once it is evicted."""
    if labels is None:
        return {}
    changes: dict[str, str | None] = {k: READY for k in ready if labels.get(k) != READY}
    changes.update({k: None for k, v in labels.items()
                    if is_readiness_label(k) and k not in ready and not (k in stored and v == READY)})
    return changes


def _ids(held: Mapping[str, Held], keep: Callable[[Held], bool]) -> set[str]:
    return {h.snapshot for h in held.values() if keep(h)}


class Reconciler:
    """Runs passes on change events and every `resyncSeconds`."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.held: dict[str, Held] = {}
        self._wake = asyncio.Event()
        self._reported: dict[str, tuple[str, str | None]] = {}  # name -> (phase, snapshot or message)
        self._fetching: dict[str, asyncio.Task[None]] = {}  # want name -> its fetch
        self.passes = 0
        self._taint_due: float | None = None  # seconds from the last pass to the startup taint's deadline
        # one pass at a time: settle() diffs against `held`, which a pass sets only at its end, so a second pass
        # started meanwhile (the loop's, and a caller's) diffed against the stale one: a demotion went missing
        self._passing = asyncio.Lock()
        self._book, self._views = VolumeBook(node.store.tree), StreamViews(node.store.layout)  # adapter directories

    def kick(self) -> None:
        """Wake the loop; call on the event loop's thread (use loop.call_soon_threadsafe from others)."""
        self._wake.set()

    async def run(self, *, iterations: int | None = None) -> None:
        """Eternal unless `iterations` (tests) bounds it. In cluster mode nothing runs before the first full
        list of ModelCaches: a pass on an empty list would unpin everything."""
        while iterations is None or self.passes < iterations:
            self._wake.clear()
            cluster = self.node.cluster
            if cluster is None or cluster.synced():
                try:
                    await self.once()
                except Exception:  # level-triggered: log, and the next pass starts over
                    log.exception("reconcile pass failed")
            timeout = self.node.settings.models.resync_seconds
            if self._taint_due is not None:  # wake just past the deadline, not up to a resync later
                timeout = min(timeout, self._taint_due + 0.05)
            # asyncio.timeout, not wait_for: 3.11's wait_for swallows a cancel that lands as the wake does (a kick
            # racing the daemon's stop), and the pass loop ran on while stop waited for it
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    async def once(self) -> Outcome:
        async with self._passing:
            return await self._once()

    async def _once(self) -> Outcome:
        start = time.monotonic()
        node = self.node
        everything = wants(node.settings.models.warm, await self._desired())
        wanted, grants, refused = self._authorize(everything)
        await self._report(refused)
        cached = await asyncio.to_thread(self._lookup_all, grants)  # one thread hop for all the hits
        await self._report([(w, "Ready", cached[w.name], "") for w in wanted if w.name in cached])
        for w in wanted:
            if w.name not in cached and w.name not in self._fetching:
                self._fetching[w.name] = self.node.tasks.spawn(f"keep warm {w.ref}", self._fetch(w, grants[w.name]))
        results = {name: snapshot.id for name, snapshot in cached.items()}
        outcome = settle(self.held, wanted, results, await asyncio.to_thread(self._actual))
        # a state reported but never held (a rollout's fetch done after its switch) is forgotten too
        names = {w.name for w in everything}
        if stale := {n for n in self._reported if n not in names} - set(outcome.forget):
            outcome = dataclasses.replace(outcome, forget=tuple(sorted({*outcome.forget, *stale})))
        await asyncio.to_thread(self._apply, outcome)
        await asyncio.to_thread(self._point_latest, wanted, results)
        await asyncio.to_thread(hf_layout.prune, node.store)  # hub cache views of snapshots evicted meanwhile
        await self._report_labels(outcome)
        await self._release_startup_taint(wanted, results)  # last: pods arrive to the readiness labels already set
        await adapters.fill_all(node.store, self._book, self._views, node.authority, node.fetches)
        self.held = outcome.held
        self.passes += 1
        node.metrics.reconcile_seconds.observe(time.monotonic() - start)
        log.info("reconciled %d models in %.2fs (%d cached, %d fetching)", len(wanted), time.monotonic() - start,
                 len(results), len(self._fetching))
        return outcome

    async def _desired(self) -> list[Want]:
        cluster = self.node.cluster
        if cluster is None:
            return []
        views = await asyncio.to_thread(adapters.views_by_base, self._book)  # whose adapters to fetch here
        return await asyncio.to_thread(cluster.desired, views)

    def _authorize(self, wanted: Sequence[Want]) -> tuple[list[Want], dict[str, Grant],
                                                           list[tuple[Want, str, Snapshot | None, str]]]:
        """The one decision for each want (weightcache/access.py): an admin's (config, ModelCache) for its file://
        rules and declarations; demand for the namespaces of the pods that asked, decided again here, so demand
        a namespace may not have is never fetched nor pinned. A refused want is reported Failed and not held."""
        authority = self.node.authority
        allowed: list[Want] = []
        grants: dict[str, Grant] = {}
        refused: list[tuple[Want, str, Snapshot | None, str]] = []
        for w in wanted:
            try:
                grants[w.name] = (authority.authorize(w.ref, ADMIN) if w.namespaces is None
                                  else authority.authorize_any(w.ref, w.namespaces))
                allowed.append(w)
            except NotAllowedError as exc:
                log.warning("not keeping %s: %s", w.ref, exc)
                refused.append((w, "Failed", None, f"refused by policy: {exc}"))
        return allowed, grants, refused

    def _lookup_all(self, grants: Mapping[str, Grant]) -> dict[str, Snapshot]:
        found = {name: self._lookup(grant) for name, grant in grants.items()}
        return {name: snapshot for name, snapshot in found.items() if snapshot is not None}

    def _lookup(self, grant: Grant) -> Snapshot | None:
        try:
            return self.node.fetcher.lookup(grant)
        except SignatureError:  # cached, but not as its ModelCache requires: its fetch reports why (Failed)
            return None

    async def _fetch(self, w: Want, grant: Grant) -> None:
        """Fetch one missing model through the daemon's fetch queue (`parallelModels` downloads at once, in the
        order asked: highest priority first). Success wakes the loop (to pin and label it); a failure is reported
        and retried on the next pass, not at once."""
        cluster = self.node.cluster
        progress = None
        if cluster is not None and w.model_cache is not None:
            def progress(p: Progress) -> None:  # on the fetch's thread; the reporter coalesces these
                cluster.progress(w, p.bytes_done, p.bytes_total)
        try:
            await self._report([(w, "Fetching", None, "")])
            snapshot = await self.node.ensure(grant, progress=progress)
        except Exception as exc:  # one bad model must not stop the others; its status says why
            log.warning("keeping %s warm failed: %s", w.ref, exc)
            await self._report([(w, "Failed", None, str(exc))])
            return
        finally:
            self._fetching.pop(w.name, None)
        await self._report([(w, "Ready", snapshot, "")])
        self.kick()

    async def _report(self, states: Sequence[tuple[Want, str, Snapshot | None, str]]) -> None:
        """Send ModelCache states that changed since last reported, in one batch."""
        if self.node.cluster is None:
            return
        batch = []
        for w, phase, snapshot, message in states:
            key = (phase, snapshot.id if snapshot is not None else message)
            if w.model_cache is not None and self._reported.get(w.name) != key:
                self._reported[w.name] = key
                batch.append((w, phase, snapshot, message))
        if batch:
            await asyncio.to_thread(self.node.cluster.report_many, batch)

    async def _release_startup_taint(self, wanted: Sequence[Want], results: Mapping[str, str]) -> None:
        """After pins and promotions: the startup taint goes once the warm-first models are in place."""
        cluster, tier, histogram = self.node.cluster, self.node.tier, self.node.metrics.startup_taint_seconds
        if cluster is None:
            return
        def release_now() -> float | None:
            resident = frozenset(i.id for i in tier.resident()) if tier is not None else frozenset()
            waiting = startup_taint.waiting_on(wanted, results, resident)
            return startup_taint.release(cluster, waiting, self.node.settings.cluster.startup_taint_deadline,
                                         observe=lambda why, seconds: histogram.labels(why).observe(seconds))
        self._taint_due = await asyncio.to_thread(release_now)

    def _actual(self) -> Actual:
        node = self.node
        pinned = frozenset(i.snapshot.id for i in node.store.list()
                           if i.pinned and PIN_OWNER in node.store.pins(i.snapshot.id))
        resident = frozenset(i.id for i in node.tier.resident()) if node.tier is not None else frozenset()
        labels = node.cluster.node_labels() if node.cluster is not None else None
        return Actual(pinned, resident, labels, _stored_labels(node) if labels is not None else frozenset())

    def _apply(self, o: Outcome) -> None:
        store, tier = self.node.store, self.node.tier
        for sid in o.pin:
            _try(f"pin {sid}", lambda i: store.pin(i, by=PIN_OWNER), sid)
        for sid in o.unpin:
            _try(f"unpin {sid}", lambda i: store.unpin(i, by=PIN_OWNER), sid)
        if tier is not None:
            for sid in o.demote:
                _try(f"demote {sid}", tier.demote, sid)
            for sid in o.promote:
                _try(f"promote {sid}", lambda s: tier.promote(store.get(s), pinned=True), sid)

    def _point_latest(self, wanted: Sequence[Want], results: Mapping[str, str]) -> None:
        """The store's `latest` ref of a selection names the snapshot of the revision its ModelCache serves, so a
        pod that names no revision gets it (a rollout's switch moves it; weightcache/kube/rollout.py). The first
        want of a selection wins: highest priority, then name."""
        seen: set[str] = set()
        for w in wanted:
            if w.serves and w.name in results and w.ref.key not in seen:
                seen.add(w.ref.key)
                _try(f"pointing {w.ref.uri} at {results[w.name][:12]}", self.node.store.point,
                     dataclasses.replace(w.ref, revision=None), results[w.name])

    async def _report_labels(self, o: Outcome) -> None:
        cluster = self.node.cluster
        if cluster is None:
            return
        if o.labels:
            await asyncio.to_thread(cluster.set_labels, o.labels)
        for name in o.forget:
            self._reported.pop(name, None)
            await asyncio.to_thread(cluster.forget, name)


def _stored_labels(node: Node) -> frozenset[str]:
    return frozenset(key for keys in stored_labels(node.store).values() for key in keys)


def stored_labels(store: Store) -> dict[str, list[str]]:
    """Snapshot id -> the readiness label of every selection it answers, for each complete snapshot in the store: a
    ref's model key is `ModelRef.key` (uri + globs), the very hash `readiness_label` names; eviction deletes the
    snapshot's refs."""
    out: dict[str, list[str]] = {}
    for sid, key in store.index.query(
            "SELECT DISTINCT r.snapshot_id, r.model_key FROM refs r JOIN snapshots s ON s.id = r.snapshot_id"):
        out.setdefault(str(sid), []).append(READINESS_LABEL_PREFIX + str(key))
    return out


def _try(what: str, fn: Callable[..., object], *args: Any) -> None:
    try:
        fn(*args)
    except Exception as exc:  # level-triggered: the next pass retries
        log.warning("%s failed: %s", what, exc)
