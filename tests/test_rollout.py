"""Revision rollouts (weightcache/kube/rollout.py) across three real daemons and the placement controller, on the
stand-in API server: a new spec.revision is fetched beside the old on every node that holds the model, at most
`maxConcurrent` at a time, then every node switches (pin, `latest` ref, report) while a running pod's lease keeps
the old snapshot; a revision a node cannot fetch stops the rollout with the node and the reason."""

from __future__ import annotations

import asyncio
import io
import json
import threading
from pathlib import Path
from typing import Any

import yaml

from tests.fake_apiserver import FakeApiServer
from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import RunningDaemon, eventually, start_daemon
from tests.fixtures_kube import NODE
from tests.fixtures_s3 import S3
from tests.peers_fleet import origin_bytes
from weightcache.fetch import source_revision
from weightcache.kube import rollout
from weightcache.kube.client import load_api_client
from weightcache.kube.cluster_cli import status as cli_status
from weightcache.placement.command import start_controller
from weightcache.sources import open_source
from weightcache.uri import parse_ref

MERGE = "application/merge-patch+json"
NODES = (NODE, "gpu-2", "gpu-3")


def _status(cluster: FakeApiServer) -> dict[str, Any]:
    return dict(cluster.get("modelcaches", "llama").get("status") or {})


def _models(cluster: FakeApiServer, node: str) -> dict[str, Any]:
    found = [o for o in cluster.list("modelcachenodes") if o["metadata"]["name"] == node]
    return dict(((found[0].get("status") or {}).get("models") or {}) if found else {})


def _printed(mc: dict[str, Any]) -> dict[str, Any]:
    """The CRD's printer columns over `.status` (what `kubectl get mc` shows), read off the object."""
    crd = yaml.safe_load((Path(__file__).parents[1] / "deploy/daemonset/crd-modelcache.yaml").read_text())
    shown = {}
    for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]:
        if column["jsonPath"].startswith(".status."):
            value: Any = mc
            for part in column["jsonPath"].split(".")[1:]:
                value = (value or {}).get(part)
            shown[column["name"]] = value
    return shown


def _watch_fetching(cluster: FakeApiServer, stop: threading.Event, seen: list[int]) -> None:
    while not stop.wait(0.02):
        seen.append(len((_status(cluster).get("rollout") or {}).get("fetching") or []))


async def test_a_new_revision_rolls_out_over_three_daemons_and_a_failed_fetch_stops_the_next(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    for name in NODES[1:]:
        cluster.create("nodes", {"metadata": {"name": name, "labels": {"pool": "a100"}}})
    uri = f"file://{model_copy}/"
    ref = parse_ref(uri)
    cluster.create("modelcaches", {"metadata": {"name": "llama"}, "spec": {
        "source": uri, "nodeSelector": {"pool": "a100"}, "allowedNamespaces": ["inference"],
        "rollout": {"maxConcurrent": 2}}})
    stop_controller = start_controller(load_api_client())
    daemons: list[RunningDaemon] = []
    try:
        for name in NODES:
            (short_dir / name).mkdir()
            daemons.append(await start_daemon(short_dir / name, model_copy, env={"NODE_NAME": name}))
        await eventually(lambda: all(_models(cluster, n).get("llama", {}).get("phase") == "Ready" for n in NODES),
                         timeout=30, what="every node to hold the first revision")
        await eventually(lambda: _status(cluster).get("revision") == "", what="the controller to take it in hand")
        old = daemons[0].daemon.node.store.lookup(ref)
        assert old is not None
        daemons[0].daemon.node.store.lease("pod/inference/llama-0", old.id)  # a pod that runs on the old one

        (model_copy / "config.json").write_text(json.dumps({"model_type": "llama", "revision": 2}))
        source = open_source(ref)
        new_revision = source_revision(source.list())[:16]
        source.close()
        stop, seen = threading.Event(), []
        watcher = threading.Thread(target=_watch_fetching, args=(cluster, stop, seen), daemon=True)
        watcher.start()
        cluster.patch("modelcaches", "llama", {"spec": {"revision": new_revision}}, MERGE)
        try:
            await eventually(lambda: _status(cluster).get("revision") == new_revision, timeout=30,
                             what="the switch to the new revision")
        finally:
            stop.set()
            watcher.join()
        done = _status(cluster)["rollout"]
        assert (done["phase"], done["from"], done["to"], done["progress"]) == ("Complete", "", new_revision, "3/3")
        assert done["new"] == sorted(NODES) and done["old"] == done["fetching"] == done["failed"] == []
        assert max(seen) <= 2, "at most maxConcurrent nodes fetch at once"
        assert _printed(cluster.get("modelcaches", "llama")) == {
            "Serving": new_revision, "Rollout": "Complete", "Nodes": "3/3"}, "kubectl get mc's columns"

        def switched(d: RunningDaemon) -> bool:
            latest = d.daemon.node.store.lookup(ref)  # what a pod naming no revision mounts now
            return latest is not None and latest.id != old.id and b'"revision": 2' in (
                latest.path / "config.json").read_bytes()

        for d, name in zip(daemons, NODES, strict=True):
            await eventually(lambda d=d: switched(d), what=f"{name}'s latest ref to move")
            store = d.daemon.node.store
            new = store.lookup(ref)
            assert new is not None
            await eventually(lambda store=store, new=new: [i.snapshot.id for i in store.list() if i.pinned]
                             == [new.id], what=f"{name} to pin only the new revision")
            await eventually(lambda name=name, new=new: _models(cluster, name).get("llama", {}).get("snapshot")
                             == new.id and rollout.next_key("llama", new_revision) not in _models(cluster, name),
                             what=f"{name}'s report to name the new snapshot and drop the rollout's entry")
            assert cluster.get("nodes", name)["metadata"]["labels"].get(ref.label_key) == "ready"
        assert daemons[0].daemon.node.store.get(old.id).path.is_dir(), "the running pod keeps its revision"

        # A revision the source does not have: the first node asked fails, and nobody else is asked.
        cluster.patch("modelcaches", "llama", {"spec": {"revision": "0badc0ffee00", "rollout": {"maxConcurrent": 1}}},
                      MERGE)
        failed = await eventually(lambda: (_status(cluster).get("rollout") or {}).get("phase") == "Failed"
                                  and _status(cluster)["rollout"], timeout=30, what="the rollout to stop")
        assert len(failed["nodes"]) == 1 and failed["failed"] == failed["nodes"]
        assert failed["message"].startswith(f"node {failed['nodes'][0]} could not fetch revision 0badc0ffee00: ")
        assert "neither a cached snapshot nor the source's current content" in failed["message"]
        assert _status(cluster)["revision"] == new_revision, "nothing switched"
        await asyncio.sleep(3)  # a few controller passes: still stopped, still one node asked
        assert _status(cluster)["rollout"]["nodes"] == failed["nodes"]
        assert all(d.daemon.node.store.lookup(ref).id == new.id for d in daemons)  # type: ignore[union-attr]

        out = io.StringIO()
        assert await asyncio.to_thread(cli_status, load_api_client(), "llama", out=out) == 0
        assert f"<rollout {new_revision} -> 0badc0ffee00>  Failed" in out.getvalue()
    finally:
        for d in daemons:
            await d.daemon.stop()
        stop_controller()


def _mc(revision: str, status: dict[str, Any] | None = None, generation: int = 2, **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": "m", "generation": generation}, "spec": {"revision": revision, **spec},
            "status": status or {}}


def _held(phase: str = "Ready", **extra: Any) -> dict[str, Any]:
    return {"phase": phase, **extra}


def test_step_asks_nodes_holding_the_old_revision_first_within_max_concurrent() -> None:
    reports = {"a": {"m": _held("Fetching")}, "b": {"m": _held()}, "c": {"m": _held()}, "d": {}}
    patch = rollout.step(_mc("r2", {"revision": "r1"}, rollout={"maxConcurrent": "50%"}), reports)
    assert patch is not None
    r = patch["rollout"]
    assert (r["phase"], r["from"], r["to"], r["progress"]) == ("Progressing", "r1", "r2", "0/3")
    assert r["fetching"] == ["b", "c"] and r["old"] == ["a"], "node d does not hold the model: not a target"
    assert "revision" not in patch
    # b done: a's turn; then all done: the switch
    reports["b"]["m@r2"] = _held()
    patch = rollout.step(_mc("r2", {"revision": "r1", "rollout": r}, rollout={"maxConcurrent": "50%"}), reports)
    assert patch is not None and patch["rollout"]["fetching"] == ["a", "c"] and patch["rollout"]["new"] == ["b"]
    for n in ("a", "c"):
        reports[n]["m@r2"] = _held()
    patch = rollout.step(_mc("r2", {"revision": "r1", "rollout": patch["rollout"]}), reports)
    assert patch is not None and patch["revision"] == "r2" and patch["rollout"]["phase"] == "Complete"


def test_step_stops_at_a_failure_of_this_generation_and_restarts_on_an_edit() -> None:
    started = {"from": "r1", "to": "r2", "phase": "Progressing", "generation": 2, "nodes": ["a"]}
    reports = {"a": {"m": _held(), "m@r2": _held("Failed", message="no space", observedGeneration=1)},
               "b": {"m": _held()}}
    patch = rollout.step(_mc("r2", {"revision": "r1", "rollout": started}), reports)
    assert patch is not None and patch["rollout"]["phase"] == "Progressing", "a failure of an older attempt"
    reports["a"]["m@r2"]["observedGeneration"] = 2
    patch = rollout.step(_mc("r2", {"revision": "r1", "rollout": started}), reports)
    assert patch is not None
    stopped = patch["rollout"]
    assert stopped["phase"] == "Failed"
    assert stopped["message"].startswith("node a could not fetch revision r2: no space")
    assert rollout.step(_mc("r2", {"revision": "r1", "rollout": stopped}), reports) is None, "stays stopped"
    again = rollout.step(_mc("r2", {"revision": "r1", "rollout": stopped}, generation=3), reports)
    assert again is not None and again["rollout"]["phase"] == "Progressing" and again["rollout"]["nodes"] == ["a"]
    # set back before the switch: the rollout is dropped; nodes serve r1 as before
    assert rollout.step(_mc("r1", {"revision": "r1", "rollout": stopped}), reports) == {"rollout": None}


def test_daemon_side_serves_status_revision_and_fetches_the_next_only_when_asked() -> None:
    mc = _mc("r2", {"revision": "r1", "rollout": {"phase": "Progressing", "to": "r2", "nodes": ["a"]}})
    assert rollout.revisions(mc, "a") == ("r1", "r2")
    assert rollout.revisions(mc, "b") == ("r1", None)
    assert rollout.revisions(_mc("r2"), "a") == ("r2", None), "before the controller's first pass: the spec's"
    mc["status"]["rollout"]["phase"] = "Failed"
    assert rollout.revisions(mc, "a") == ("r1", None)


async def test_a_rollout_fills_later_nodes_from_the_peers_that_fetched_first(
        cluster: FakeApiServer, s3: S3, fault_proxy: FaultProxy, short_dir: Path, model_copy: Path) -> None:
    """maxConcurrent 1 over two daemons with peers: the first node asked reads the new revision from the origin,
    the second from that node, so the origin serves the new bytes once."""
    # 2 MiB each: one piece, too big a share of its blob for a peer's first piece to be judged by the origin's bytes
    # (docs/peers.md, "The lying peer"), so every byte the second node reads comes from the first
    old, new = bytes(range(256)) * 8192, bytes(reversed(range(256))) * 8192
    s3.put("models", "m/w.bin", old, ChecksumAlgorithm="SHA256")
    token = short_dir / "peer-token"
    token.write_text("rollout-peer-token-0123456789")
    config = {"peerTokenFile": str(token), "peerListen": "127.0.0.1:0",
              "endpoints": {"s3": {"endpointUrl": fault_proxy.endpoint_url}}}
    cluster.create("nodes", {"metadata": {"name": "gpu-2", "labels": {"pool": "a100"}}})
    cluster.create("modelcaches", {"metadata": {"name": "llama"}, "spec": {
        "source": "s3://models/m/", "nodeSelector": {"pool": "a100"}, "allowedNamespaces": ["*"]}})
    stop_controller = start_controller(load_api_client())
    daemons: list[RunningDaemon] = []
    try:
        for name in (NODE, "gpu-2"):
            (short_dir / name).mkdir()
            daemons.append(await start_daemon(short_dir / name, model_copy, config=config, env={"NODE_NAME": name}))
        await eventually(lambda: all(_models(cluster, n).get("llama", {}).get("phase") == "Ready"
                                     for n in (NODE, "gpu-2")) and _status(cluster).get("revision") == "",
                         timeout=30, what="both nodes on the first revision")
        peers = daemons[1].daemon.node.fetcher.peers  # asked second (nodes in name order): it reads from gpu-1
        assert peers is not None
        await eventually(lambda: peers.urls == [f"http://127.0.0.1:{daemons[0].daemon.peer_port}"], timeout=30,
                         what="gpu-2 to find gpu-1")
        s3.put("models", "m/w.bin", new, ChecksumAlgorithm="SHA256")
        source = open_source(parse_ref("s3://models/m/"), endpoint_url=fault_proxy.endpoint_url)
        revision = source_revision(source.list())[:16]
        source.close()
        fault_proxy.clear()
        cluster.patch("modelcaches", "llama", {"spec": {"revision": revision}}, MERGE)
        await eventually(lambda: _status(cluster).get("revision") == revision, timeout=30, what="the switch")
        assert origin_bytes(fault_proxy, "/models/m/") == len(new), "the second node read it from the first"
        def serves_new(d: RunningDaemon) -> bool:
            snapshot = d.daemon.node.store.lookup(parse_ref("s3://models/m/"))
            return snapshot is not None and (snapshot.path / "w.bin").read_bytes() == new

        for d in daemons:  # each daemon moves its `latest` at its first pass after the switch
            await eventually(lambda d=d: serves_new(d), what="the node to serve the new revision")
    finally:
        for d in daemons:
            await d.daemon.stop()
        stop_controller()
