"""desired: which ModelCaches a node holds, as a pure function of plain data."""

from __future__ import annotations

import time

from tests.fake_apiserver import model_cache
from weightcache.kube.desired import DesiredModel, InvalidSpec, plan, selects
from weightcache.uri import readiness_label

GPU = {"gpu": "h100", "zone": "a", "kubernetes.io/hostname": "n1"}


def test_selects_is_exact_match_of_every_key():
    assert selects(GPU, {"gpu": "h100"})
    assert selects(GPU, {"gpu": "h100", "zone": "a"})
    assert not selects(GPU, {"gpu": "h100", "zone": "b"})
    assert not selects(GPU, {"gpu": "H100"})
    assert not selects(GPU, {"missing": ""})


def test_empty_or_missing_selector_selects_no_node():
    assert not selects(GPU, {})
    assert not selects(GPU, None)
    assert plan([model_cache("grant-only", "s3://models/a/")], GPU) == ([], [])


def test_plan_parses_the_spec_and_sorts_by_priority_then_name():
    mcs = [
        model_cache("b", "s3://models/b/", node_selector={"gpu": "h100"}),
        model_cache("a", "s3://models/a/", node_selector={"gpu": "h100"}, tier="memory", include=["*.safetensors"]),
        model_cache("z", "s3://models/z/", node_selector={"gpu": "h100"}, priority=5, revision="v2"),
        model_cache("other", "s3://models/o/", node_selector={"gpu": "a10"}),
    ]
    mcs[0]["metadata"]["generation"] = 4
    got, _ = plan(mcs, GPU)
    assert [d.name for d in got] == ["z", "a", "b"]
    z, a, b = got
    assert z.priority == 5 and z.ref.revision == "v2" and z.tier == "disk"
    assert a.tier == "memory" and a.ref.include == ("*.safetensors",)
    assert b.label_key == readiness_label("s3://models/b/") and b.generation == 4
    assert isinstance(b, DesiredModel)


def test_invalid_specs_are_skipped_and_reported_by_name():
    sel = {"gpu": "h100"}
    mcs = [
        model_cache("ok", "s3://models/ok/", node_selector=sel),
        model_cache("bad-scheme", "ftp://models/x/", node_selector=sel),
        model_cache("bad-tier", "s3://models/x/", node_selector=sel, tier="ssd"),
        model_cache("bad-glob", "s3://models/x/", node_selector=sel, include="*.bin"),
        model_cache("creds", "https://user:pw@host/x/", node_selector=sel),
        model_cache("not-mine", "ftp://nope", node_selector={"gpu": "a10"}),  # not selected: not this node's problem
    ]
    wanted, invalid = plan(mcs, GPU)
    assert [d.name for d in wanted] == ["ok"]
    assert [i.name for i in invalid] == ["bad-scheme", "bad-tier", "bad-glob", "creds"]
    assert all(isinstance(i, InvalidSpec) and i.error for i in invalid)
    assert "pw" not in invalid[3].error and "user" not in invalid[3].error


def test_five_hundred_model_caches_plan_fast():
    mcs = [model_cache(f"m{i:03d}", f"s3://models/m{i}/", node_selector={"gpu": "h100"} if i % 2 else {"gpu": "a10"},
                       priority=i % 7) for i in range(500)]
    start = time.thread_time()  # CPU time: a loaded machine stretches wall time, not this
    wanted, _ = plan(mcs, GPU)
    assert time.thread_time() - start < 0.5  # a loose bound: the real figure is in scripts/bench_daemon.py
    assert len(wanted) == 250


def test_demand_says_who_asked_and_an_admins_modelcache_says_nobody():
    """The daemon authorizes the controller's demand for the namespaces of its pods, never as an admin's."""
    admin = model_cache("admin", "s3://models/a/", node_selector={"gpu": "h100"}, allowedNamespaces=["x"],
                        demandNamespaces=["forged"])  # not the controller's: the field means nothing
    demand = model_cache("placement-1", "s3://models/b/", nodeNames=["n1"], demandNamespaces=["team-b", "team-a"])
    nobody = model_cache("placement-2", "s3://models/c/", nodeNames=["n1"])
    for mc in (demand, nobody):
        mc["metadata"]["labels"] = {"app.kubernetes.io/managed-by": "weightcache-placement"}
    got = {d.name: d.namespaces for d in plan([admin, demand, nobody], GPU, "n1")[0]}
    assert got == {"admin": None, "placement-1": ("team-a", "team-b"), "placement-2": ()}
