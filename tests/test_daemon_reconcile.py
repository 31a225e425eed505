"""Reconcile: the pure settle() on plain data, and whole passes against a real store."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_kube import NODE
from weightcache.daemon.config import parse_settings
from weightcache.daemon.node import Want
from weightcache.daemon.reconcile import PIN_OWNER, READY, Actual, Held, settle, wants
from weightcache.uri import ModelRef, parse_ref, readiness_label


def want(name: str, source: str, *, tier: str = "disk", pin: bool = True, priority: int = 0) -> Want:
    return Want(name, parse_ref(source), tier, pin, priority)


def test_new_wants_are_pinned_promoted_and_labelled() -> None:
    w = [want("a", "s3://models/a/"), want("b", "s3://models/b/", tier="memory")]
    o = settle({}, w, {"a": "snap-a", "b": "snap-b"}, Actual(labels={}))
    assert o.pin == {"snap-a", "snap-b"} and not o.unpin
    assert o.promote == {"snap-b"} and not o.demote
    assert o.labels == {w[0].ref.label_key: READY, w[1].ref.label_key: READY}
    assert o.held["a"] == Held("snap-a", True, "disk", w[0].ref.label_key)


def test_what_is_no_longer_wanted_is_undone_level_triggered() -> None:
    """After a restart `old` is empty: the daemon's pins and labels in the world still get cleaned."""
    stale_label = parse_ref("s3://models/deleted/").label_key
    actual = Actual(pinned=frozenset({"snap-a", "snap-gone"}), labels={stale_label: READY, "zone": "x"})
    w = [want("a", "s3://models/a/")]
    o = settle({}, w, {"a": "snap-a"}, actual)
    assert o.unpin == {"snap-gone"} and not o.pin
    assert o.labels == {w[0].ref.label_key: READY, stale_label: None}  # other labels are not ours


def test_a_ready_label_stays_while_its_snapshot_is_in_the_store() -> None:
    """The last pod went, so did the demand: the snapshot is still on disk, and so the label stays (a scale from
    zero finds the node ready, no gate round trip). Once evicted (its refs gone from the store) it goes."""
    kept, evicted = parse_ref("s3://models/kept/").label_key, parse_ref("s3://models/evicted/").label_key
    globbed = ModelRef("s3", "models", "kept/", include=("*.json",)).label_key
    labels = {kept: READY, evicted: READY, globbed: READY, "zone": "x"}
    o = settle({}, [], {}, Actual(labels=labels, stored=frozenset({kept})))
    assert o.labels == {evicted: None, globbed: None}  # a selection is its own: the whole model is not *.json
    o = settle({}, [], {}, Actual(labels={kept: "fetching"}, stored=frozenset({kept})))
    assert o.labels == {kept: None}  # only `ready` is kept: another value was never this code's
    o = settle({}, [], {}, Actual(labels={kept: READY}, stored=frozenset({kept})))
    assert o.labels == {}
    assert settle({}, [], {}, Actual(labels=None, stored=frozenset({kept}))).labels == {}  # off-cluster


def test_a_stored_snapshot_never_adds_a_label_nobody_wanted() -> None:
    """A snapshot a CSI publish fetched on demand is not labelled by its presence alone: only kept."""
    o = settle({}, [], {}, Actual(labels={}, stored=frozenset({parse_ref("s3://models/x/").label_key})))
    assert o.labels == {}


def test_a_failed_ensure_keeps_what_it_held() -> None:
    w = [want("a", "s3://models/a/")]
    old = {"a": Held("snap-a1", True, "disk", w[0].ref.label_key)}
    o = settle(old, w, {}, Actual(pinned=frozenset({"snap-a1"}), labels={w[0].ref.label_key: READY}))
    assert o.held == old and not o.pin and not o.unpin and o.labels == {}


def test_a_new_revision_moves_the_pin_and_deleted_modelcaches_are_forgotten() -> None:
    w = [want("a", "s3://models/a/", tier="memory")]
    old = {"a": Held("snap-a1", True, "memory", w[0].ref.label_key),
           "gone": Held("snap-g", True, "memory", "weightcache.io/mgone"),
           "config/mkey": Held("snap-c", True, "disk", "weightcache.io/mc")}
    actual = Actual(pinned=frozenset({"snap-a1", "snap-g", "snap-c"}), resident=frozenset({"snap-a1", "snap-g"}))
    o = settle(old, w, {"a": "snap-a2"}, actual)
    assert o.pin == {"snap-a2"} and o.unpin == {"snap-a1", "snap-g", "snap-c"}
    assert o.promote == {"snap-a2"} and o.demote == {"snap-a1", "snap-g"}
    assert o.forget == ("gone",)  # config models have no ModelCache status to forget
    assert o.labels == {}  # off-cluster: no labels


def test_unpinned_wants_and_shared_snapshots() -> None:
    w = [want("a", "s3://models/a/", pin=False), want("b", "s3://models/b/")]
    o = settle({}, w, {"a": "same", "b": "same"}, Actual())
    assert o.pin == {"same"}  # b pins it; a does not unpin what b wants


def test_wants_orders_by_priority_then_name() -> None:
    config = parse_settings({"models": [{"source": "s3://models/c/"}]}).models.warm
    picked = wants(config, [want("z", "s3://models/z/", priority=5), want("b", "s3://models/b/")])
    assert [w.name for w in picked] == ["z", "b", config[0].name]


def test_settle_scales_to_a_thousand_models() -> None:
    w = [want(f"mc-{i}", f"s3://models/m{i}/") for i in range(1000)]
    o = settle({}, w, {x.name: f"snap-{i}" for i, x in enumerate(w)}, Actual(labels={}))
    assert len(o.pin) == 1000 and len(o.labels) == 1000


async def test_pass_pins_config_models_as_daemon_and_never_takes_a_users_pin(short_dir: Path,
                                                                            model_copy: Path) -> None:
    d = await start_daemon(short_dir, model_copy, config={"models": [{"source": f"file://{model_copy}/"}],
                                                          "resyncSeconds": 3600})
    try:
        node, rec = d.daemon.node, d.daemon.reconciler
        held = await eventually(lambda: rec.held, what="the model fetched and held")  # then the loop sleeps
        (sid,) = [h.snapshot for h in held.values()]
        assert node.store.pins(sid) == [PIN_OWNER]
        node.store.pin(sid)  # a person pins it too (`weightcache pin`)
        node.settings = parse_settings({"models": []})
        outcome = await rec.once()
        assert outcome.unpin == {sid} and node.store.pins(sid) == ["user"]
    finally:
        await d.daemon.stop()


async def test_one_failing_model_does_not_stop_the_others(short_dir: Path, model_copy: Path) -> None:
    d = await start_daemon(short_dir, model_copy, config={
        "resyncSeconds": 3600,
        "models": [{"source": f"file://{short_dir}/missing/"}, {"source": f"file://{model_copy}/"}]})
    try:
        rec = d.daemon.reconciler
        await eventually(lambda: rec.held, what="the good model held")
        pinned = [i for i in d.daemon.node.store.list() if i.pinned]
        assert [i.snapshot.uri for i in pinned] == [f"file://{model_copy}/"] and len(rec.held) == 1
    finally:
        await d.daemon.stop()


async def test_memory_tier_models_are_locked_and_released_when_no_longer_wanted(short_dir: Path,
                                                                                 model_copy: Path) -> None:
    d = await start_daemon(short_dir, model_copy, config={
        "memoryBudget": "64Mi", "resyncSeconds": 3600,
        "models": [{"source": f"file://{model_copy}/", "tier": "memory"}]})
    try:
        node, rec = d.daemon.node, d.daemon.reconciler
        (resident,) = await eventually(node.tier.resident, what="the model resident in memory")
        assert resident.pinned and resident.bytes >= sum(p.stat().st_size for p in model_copy.iterdir())
        metrics = await asyncio.to_thread(d.client.metrics)
        assert f"weightcache_memory_tier_locked_bytes {float(resident.bytes)}" in metrics
        node.settings = parse_settings({"memoryBudget": "64Mi", "models": []})
        outcome = await rec.once()
        assert outcome.demote == {resident.id} and node.tier.locked_bytes() == 0
    finally:
        await d.daemon.stop()


async def test_passes_run_one_at_a_time_so_a_second_settles_against_the_first(short_dir: Path,
                                                                               model_copy: Path) -> None:
    """A caller's pass beside the loop's (CI saw it): both diffed against the same stale `held`, so the second
    demoted nothing while the first was still running, or both demoted the same model."""
    d = await start_daemon(short_dir, model_copy, config={
        "memoryBudget": "64Mi", "resyncSeconds": 3600,
        "models": [{"source": f"file://{model_copy}/", "tier": "memory"}]})
    try:
        node, rec = d.daemon.node, d.daemon.reconciler
        await eventually(lambda: any(h.tier == "memory" for h in rec.held.values()) and node.tier.resident(),
                         what="the model held and resident in memory")
        (resident,) = node.tier.resident()
        node.settings = parse_settings({"memoryBudget": "64Mi", "models": []})
        first, second = await asyncio.gather(rec.once(), rec.once())
        assert (first.demote, second.demote) == ({resident.id}, frozenset())
        assert node.tier.locked_bytes() == 0 and rec.held == {}
    finally:
        await d.daemon.stop()


async def test_turning_the_memory_tier_on_and_off_live(short_dir: Path, model_copy: Path) -> None:
    d = await start_daemon(short_dir, model_copy, config={"resyncSeconds": 3600})
    try:
        daemon, rec = d.daemon, d.daemon.reconciler
        await eventually(lambda: rec.passes >= 1, what="the first pass")
        assert daemon.node.tier is None
        await daemon.apply(parse_settings({"memoryBudget": "64Mi", "resyncSeconds": 3600,
                                           "models": [{"source": f"file://{model_copy}/", "tier": "memory"}]}))
        await eventually(lambda: daemon.node.tier is not None and daemon.node.tier.locked_bytes() > 0,
                         what="the model to be locked in memory")
        tier = daemon.node.tier
        await daemon.apply(parse_settings({"resyncSeconds": 3600}))
        assert daemon.node.tier is None and tier.locked_bytes() == 0
    finally:
        await d.daemon.stop()


async def test_the_label_outlives_the_modelcache_until_eviction(cluster: FakeApiServer, short_dir: Path,
                                                                model_copy: Path) -> None:
    """Against the fake API server: ModelCache -> `ready`; ModelCache deleted (unpinned, snapshot on disk) ->
    still `ready` after further passes; snapshot evicted -> the label goes at the next pass."""
    uri = f"file://{model_copy}/"
    cluster.create("modelcaches", {"metadata": {"name": "llama"}, "spec": {
        "source": uri, "nodeSelector": {"pool": "a100"}, "allowedNamespaces": ["team-a"]}})
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    label = readiness_label(uri)
    labels = lambda: cluster.get("nodes", NODE)["metadata"].get("labels", {})  # noqa: E731
    try:
        node, rec = d.daemon.node, d.daemon.reconciler
        await eventually(lambda: labels().get(label) == READY, what="the node's readiness label")
        (info,) = node.store.list()
        cluster.delete("modelcaches", "llama")
        await eventually(lambda: not node.store.pins(info.snapshot.id), what="the daemon's pin to go")
        for _ in range(2):
            assert (await rec.once()).labels == {}
        assert labels().get(label) == READY and labels()["pool"] == "a100"
        await asyncio.to_thread(node.store.evict, info.snapshot.id)
        assert (await rec.once()).labels == {label: None}
        await eventually(lambda: label not in labels(), what="the label to go with the evicted snapshot")
        assert labels()["pool"] == "a100"
    finally:
        await d.daemon.stop()
