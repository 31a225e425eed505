"""Cluster mode against an API server speaking the real protocol: ModelCaches -> fetch, pin, node label, status."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

from tests.fake_apiserver import ApiError, FakeApiServer, RequestRecord
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_kube import NODE
from weightcache.daemon.reconcile import PIN_OWNER
from weightcache.uri import readiness_label


def model_cache(name: str, source: str, pool: str, namespaces: list[str]) -> dict:
    return {"metadata": {"name": name},
            "spec": {"source": source, "nodeSelector": {"pool": pool}, "allowedNamespaces": namespaces}}


async def test_modelcaches_drive_fetch_pin_label_and_status(cluster: FakeApiServer, short_dir: Path,
                                                            model_copy: Path) -> None:
    uri = f"file://{model_copy}/"
    cluster.create("modelcaches", model_cache("llama", uri, "a100", ["team-a"]))
    cluster.create("modelcaches", model_cache("elsewhere", f"file://{short_dir}/nope/", "h100", ["*"]))
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    label = readiness_label(uri)
    try:
        assert d.daemon.node.cluster is not None
        labels = lambda: cluster.get("nodes", NODE)["metadata"].get("labels", {})  # noqa: E731
        await eventually(lambda: labels().get(label) == "ready", what="the node's readiness label")
        status = cluster.get("modelcachenodes", NODE)["status"]["models"]
        assert set(status) == {"llama"} and status["llama"]["phase"] == "Ready"
        (info,) = d.daemon.node.store.list()
        assert status["llama"]["snapshot"] == info.snapshot.id and PIN_OWNER in d.daemon.node.store.pins(
            info.snapshot.id)
        assert (await asyncio.to_thread(d.client.ready))["checks"] == {"store": True, "modelcaches_synced": True}

        # The namespace policy: declared for team-a only; undeclared models are refused in a cluster.
        async with d.http() as http:
            for body, status_code in (({"uri": uri, "namespace": "team-a"}, 200),
                                      ({"uri": uri, "namespace": "team-b"}, 403),
                                      ({"uri": "s3://some-bucket/any/"}, 403)):
                async with http.put("/v1/models", json=body) as r:
                    assert r.status == status_code, await r.text()

        cluster.delete("modelcaches", "llama")
        await eventually(lambda: not d.daemon.node.store.pins(info.snapshot.id), what="the daemon's pin to go")
        await eventually(lambda: "llama" not in cluster.get("modelcachenodes", NODE)["status"].get("models", {}),
                         what="the node status entry to go")
        assert labels().get(label) == "ready", "the label stays while the snapshot does (scale from zero, no gate)"
        await asyncio.to_thread(d.daemon.node.store.evict, info.snapshot.id)
        d.daemon.node.kick()
        await eventually(lambda: label not in labels(), what="the label to go with the evicted snapshot")
        assert labels()["pool"] == "a100"  # labels that are not ours stay
    finally:
        await d.daemon.stop()


async def test_the_daemon_s_wait_for_the_modelcaches_ends_when_its_watch_lists_them(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    """Node.until_listed (what resumed streaming volumes wait on) is woken by the watch's list: the API server holds
    the list until the test lets it go."""
    listing = threading.Event()

    def hold_the_list(request: RequestRecord) -> None:  # on the fake API server's thread
        if request.method == "GET" and request.path.endswith("/modelcaches"):
            listing.wait(30)

    cluster.before_request = hold_the_list
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    try:
        node = d.daemon.node
        waiting = asyncio.ensure_future(node.until_listed())
        await asyncio.sleep(0.2)
        assert not node.listed() and not waiting.done()
        listing.set()
        await asyncio.wait_for(waiting, 10)
        assert node.listed()
    finally:
        listing.set()
        await d.daemon.stop()


async def test_a_failing_modelcache_reports_failed_with_an_event(cluster: FakeApiServer, short_dir: Path,
                                                                 model_copy: Path) -> None:
    cluster.create("modelcaches", model_cache("broken", f"file://{short_dir}/missing/", "a100", ["*"]))
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    try:
        def failed() -> bool:
            try:
                state = cluster.get("modelcachenodes", NODE)["status"]["models"]["broken"]
            except (KeyError, ApiError):  # not written yet
                return False
            return state["phase"] == "Failed" and "missing" in state["message"]
        await eventually(failed, what="the Failed status")
        events = await eventually(lambda: cluster.list("events", "default"), what="a FetchFailed Event")
        assert events[0]["reason"] == "FetchFailed" and events[0]["involvedObject"]["name"] == "broken"
    finally:
        await d.daemon.stop()
