"""Where a CLI command acts: the node daemon when its socket answers, else the store at --root directly.

Every command but `prefetch --cluster` goes through `open_cache(...)`, so `ls`, `evict`, `pin`, `unpin`,
`verify` and `gc` see the same store as the daemon (which may run on another root than the CLI's default) and
join its single flight. Both backends speak in the listing's dicts (`weightcache.daemon.listing.info_body`).

Read-only commands never create a store: where no store exists at the root, `StoreCache` lists nothing and
says "nothing is cached" instead of making empty directories at /var/lib/weightcache.

Snapshots are named by a reference (`s3://models/llama/[@rev]`), a full snapshot id, or an id prefix of at
least `MIN_PREFIX` characters; a prefix that matches several snapshots is refused, naming them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.errors import InUseError, InvalidReferenceError, NotCachedError, WeightcacheError

if TYPE_CHECKING:
    from weightcache.daemon.client import DaemonClient
    from weightcache.store import Store
    from weightcache.uri import ModelRef

MIN_PREFIX = 4


@dataclass
class DaemonCache:
    client: DaemonClient

    @property
    def where(self) -> str:
        return f"the daemon at {self.client.socket_path}"

    def snapshots(self) -> list[dict[str, Any]]:
        return self.client.list()

    def evict(self, snapshot_id: str) -> None:
        self.client.delete(snapshot_id)  # a 409 comes back as InUseError naming who holds it

    def evict_to(self, size: int) -> tuple[list[str], int]:
        answer = self.client.evict_to(size)
        return list(answer["evicted"]), int(answer["used_bytes"])

    def pin(self, snapshot_id: str) -> None:
        self.client.pin(snapshot_id)

    def unpin(self, snapshot_id: str) -> None:
        self.client.unpin(snapshot_id)

    def verify(self, snapshot_id: str, *, repair: bool) -> dict[str, Any]:
        return self.client.verify(snapshot_id, repair=repair)

    def gc(self) -> dict[str, Any]:
        return self.client.gc()

    def fetched_bytes(self) -> dict[str, float]:
        """Bytes this daemon fetched, by where they came from ("origin", "peers"), read from its own metrics."""
        from prometheus_client.parser import text_string_to_metric_families

        out = {"origin": 0.0, "peers": 0.0}
        for family in text_string_to_metric_families(self.client.metrics()):
            if family.name == "weightcache_model_fetched_bytes":
                for sample in family.samples:
                    if sample.name.endswith("_total") and sample.labels.get("source") in out:
                        out[sample.labels["source"]] += sample.value
        return out


@dataclass
class StoreCache:
    root: Path
    endpoint_url: str | None = None  # for verify --repair's refetch
    floor: tuple[int | None, float | None] | None = None  # (min free bytes, percent) set here; None: the store's
    _store: Store | None = None

    @property
    def where(self) -> str:
        return f"the store at {self.root}"

    def exists(self) -> bool:
        from weightcache.store.layout import Layout

        return Layout(self.root).manifests.is_dir()

    def open(self) -> Store:
        """The store, created if missing: only for commands that write. Opening evicts nothing: only the commands
        that free space (`gc`, `evict`) give space back down to the floor, after their own work."""
        if self._store is None:
            from weightcache.store import Store

            floor = self.floor or (None, None)
            self._store = Store(self.root, min_free_bytes=floor[0], min_free_percent=floor[1], evict_to_floor=False)
        return self._store

    def _existing(self) -> Store | None:
        return self.open() if self._store is not None or self.exists() else None

    def snapshots(self) -> list[dict[str, Any]]:
        from weightcache.daemon.listing import info_body

        store = self._existing()
        return [dict(info_body(i)) for i in store.list()] if store is not None else []

    def evict(self, snapshot_id: str) -> None:
        from weightcache.store.holders import describe_holder

        store = self.open()
        try:
            store.evict(snapshot_id)
        except InUseError as exc:
            held = [describe_holder(store.root, h) for h, s in store.leases().items() if s == snapshot_id]
            raise InUseError(f"{exc}" + (f". Held by: {'; '.join(held)}" if held else "")) from exc
        store.restore_floor()

    def evict_to(self, size: int) -> tuple[list[str], int]:
        store = self._existing()
        if store is None:
            return [], 0
        return store.evict_to(size) + store.restore_floor(), store.used_bytes()

    def pin(self, snapshot_id: str) -> None:
        self.open().pin(snapshot_id)

    def unpin(self, snapshot_id: str) -> None:
        self.open().unpin(snapshot_id, by="user")

    def verify(self, snapshot_id: str, *, repair: bool) -> dict[str, Any]:
        from weightcache.store import drop_damaged, verify_snapshot

        store = self.open()
        snapshot = store.get(snapshot_id)
        damaged = verify_snapshot(store, snapshot_id)
        repaired = []
        if damaged and repair:
            from weightcache.access import ADMIN, node_admin
            from weightcache.settings import flags_from, load_fetch_settings
            from weightcache.signatures import recorded_policy
            from weightcache.uri import parse_ref

            self._source_answers(parse_ref(snapshot.uri))  # before dropping: an unreachable source keeps it
            # the fetch settings prefetch and the daemon read; --endpoint-url over them
            fetch = load_fetch_settings(flags=flags_from(self))
            authority = node_admin(store.root)
            # the requirement it was published under, read before the drop removes its manifest (docs/signing.md)
            signed_by = recorded_policy(store.signature(snapshot_id), snapshot_id)
            for text in drop_damaged(store, snapshot_id, damaged) or [snapshot.uri]:
                grant = authority.authorize(parse_ref(text), ADMIN, signed_by=signed_by)
                try:
                    repaired.append({"ref": text, "snapshot": fetch.fetcher(store, grant.ref).ensure(grant).id})
                except WeightcacheError as exc:
                    raise repair_failed(exc, snapshot_id, text) from exc
        return {"id": snapshot_id, "uri": snapshot.uri, "files": len(snapshot.files), "damaged": damaged,
                "repaired": repaired, "source_checks": store.source_checks(snapshot_id),
                "signature": store.signature(snapshot_id)}

    def _source_answers(self, ref: ModelRef) -> None:
        """List the source before a repair drops anything: where it cannot be read (gone, no credentials, down),
        the damaged snapshot stays listed and the error says why, instead of the model vanishing from `ls`.
        (A snapshot id is its manifest's digest, so the refetch publishes under the same id: the old one cannot
        stay beside the new one, only until we know the source answers.)"""
        from weightcache.sources import open_source

        source = open_source(ref, endpoint_url=self.endpoint_url)
        try:
            source.list()
        except WeightcacheError as exc:
            exc.args = (f"{exc}; the damaged snapshot is kept (nothing was removed): fix the source, then run "
                        "`weightcache verify --repair` again",)
            raise
        finally:
            source.close()

    def gc(self) -> dict[str, Any]:
        from weightcache.store import GcReport, collect

        store = self._existing()
        return (collect(store) if store is not None else GcReport()).body()


def open_cache(root: str | None, default_root: str | Path, socket: str | Path, *, use_daemon: bool = True,
               endpoint_url: str | None = None, floor: Callable[[], tuple[int | None, float | None]] | None = None
               ) -> DaemonCache | StoreCache:
    """The daemon when `use_daemon`, no explicit `root`, and a daemon answers on `socket`; else the store, with
    the free-space floor `floor()` gives (asked only then: reading it imports the store, 0.1-0.3 s of a cache
    hit through the daemon)."""
    if use_daemon and not root and Path(socket).exists():
        from weightcache.daemon.client import DaemonClient

        client = DaemonClient(socket)
        if client.available():  # a socket file left by a crash is not a daemon
            return DaemonCache(client)
    return StoreCache(Path(root or default_root), endpoint_url, floor() if floor is not None else None)


def repair_failed(exc: WeightcacheError, snapshot_id: str, ref: str) -> WeightcacheError:
    """`exc` (same class, so the same exit code and HTTP status) saying plainly that the damaged snapshot is gone
    and what brings the model back."""
    exc.args = (f"snapshot {snapshot_id[:12]} of {ref} was damaged and has been removed, and refetching it failed: "
                f"{exc}. The model is no longer cached; run `weightcache prefetch {ref}` once the source answers",)
    return exc


def match(entries: list[dict[str, Any]], text: str, *, where: str) -> list[dict[str, Any]]:
    """The listed snapshots `text` names: a reference (every cached revision, or the one asked for), a snapshot
    id, or an id prefix of at least MIN_PREFIX characters that is not ambiguous."""
    text = text.strip()
    if "://" in text:
        from weightcache.uri import parse_ref

        ref = parse_ref(text)
        found = [e for e in entries if e["uri"] == ref.uri]
        if ref.revision:
            rev = ref.revision
            found = [e for e in found if rev in (e.get("revision"), e["id"]) or e["id"].startswith(rev)
                     or f"{ref.uri}@{rev}" in (e.get("refs") or [])]
    else:
        if len(text) < MIN_PREFIX:
            raise InvalidReferenceError(f"{text!r} is too short to name a snapshot; give at least {MIN_PREFIX} "
                                        "characters of its id, or the model's reference (see `weightcache ls`)")
        found = [e for e in entries if e["id"].startswith(text)]
        if len(found) > 1 and not any(e["id"] == text for e in found):
            names = ", ".join(f"{e['id'][:12]} ({e['uri']})" for e in found[:10])
            raise InvalidReferenceError(f"{text!r} matches {len(found)} snapshots: {names}; give more characters "
                                        "of the id")
    if not found:
        raise NotCachedError(f"nothing cached in {where} matches {text!r}; see `weightcache ls`")
    return found
