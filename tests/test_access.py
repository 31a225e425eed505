"""The one authorization decision below every door (weightcache/access.py), replayed as a hostile tenant would:
demand the placement controller wrote is decided again by the daemon for the namespaces that asked, host
directories under the kubelet dir are never models on any path, and a snapshot id never widens a glob grant.
A real daemon on its Unix socket, in cluster mode against the fake API server with the CRD schemas."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_kube import NODE
from weightcache.access import ADMIN, Authority, Grant
from weightcache.errors import NotAllowedError
from weightcache.fetch import Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.store import Store
from weightcache.uri import parse_ref
from weightcache.vocabulary import CONTROLLER, MANAGED_BY

TENANT, INTRUDER = "inference", "intruder"


def test_a_grant_comes_only_from_the_decision_and_the_engine_takes_nothing_else(tmp_path: Path) -> None:
    ref = parse_ref("s3://models/llama/")
    with pytest.raises(TypeError, match=r"Authority\.authorize"):
        Grant(ref, ADMIN, "forged")
    grant = Authority().authorize(ref, ADMIN)
    with pytest.raises(AttributeError):
        grant.ref = parse_ref("s3://other/secret/")  # type: ignore[misc]
    with pytest.raises(TypeError, match="takes a Grant"):
        Fetcher(Store(tmp_path / "root")).ensure(ref)  # type: ignore[arg-type]


async def test_the_fetch_queue_takes_no_bare_reference(tmp_path: Path) -> None:
    fetcher = Fetcher(Store(tmp_path / "root"))
    queue = FetchQueue(fetcher)
    try:
        with pytest.raises(TypeError, match="takes a Grant"):
            queue.start(parse_ref("s3://models/llama/"))  # type: ignore[arg-type]
    finally:
        queue.close()


def test_demand_grants_only_what_a_namespace_that_asked_may_have() -> None:
    uri = "s3://models/llama/"
    caches = [{"metadata": {"name": "grant"}, "spec": {"source": uri, "allowedNamespaces": [TENANT]}},
              demand("placement-x", uri, [INTRUDER])]
    authority = Authority(model_caches=lambda: caches, allow_undeclared=lambda: False)
    with pytest.raises(NotAllowedError, match=INTRUDER):
        authority.authorize_any(parse_ref(uri), [INTRUDER])
    with pytest.raises(NotAllowedError, match="names no namespace"):
        authority.authorize_any(parse_ref(uri), [])
    assert authority.authorize_any(parse_ref(uri), [INTRUDER, TENANT]).who.namespace == TENANT
    # demand declares nothing for the admin either: only an admin's ModelCache does
    with pytest.raises(NotAllowedError, match="no ModelCache or config entry declares"):
        authority.authorize(parse_ref("s3://models/other/"), ADMIN)
    caches.append(demand("placement-y", "s3://models/other/", [TENANT]))
    with pytest.raises(NotAllowedError):
        authority.authorize(parse_ref("s3://models/other/"), ADMIN)


def demand(name: str, source: str, namespaces: list[str] | None) -> dict[str, Any]:
    """A demand ModelCache as the placement controller writes it (or as anyone able to write one forges it)."""
    spec: dict[str, Any] = {"source": source, "nodeNames": [NODE], "allowedNamespaces": []}
    if namespaces is not None:
        spec["demandNamespaces"] = namespaces
    return {"metadata": {"name": name, "labels": {MANAGED_BY: CONTROLLER}}, "spec": spec}


def phases(cluster: FakeApiServer) -> dict[str, tuple[str, str]]:
    try:
        models = cluster.get("modelcachenodes", NODE).get("status", {}).get("models", {})
    except Exception:  # not written yet
        return {}
    return {name: (m.get("phase", ""), m.get("message", "")) for name, m in models.items()}


async def test_the_daemon_decides_demand_again_and_never_keeps_a_host_secret(
        cluster: FakeApiServer, short_dir: Path, model_copy: Path) -> None:
    kubelet = short_dir / "kubelet"
    secret = kubelet / "pods" / "uid-1" / "volumes" / "kubernetes.io~secret" / "token"
    secret.mkdir(parents=True)
    (secret / "token").write_text("another pod's service account token")
    uri = f"file://{model_copy}/"
    cluster.create("modelcaches", {"metadata": {"name": "grant"},
                                   "spec": {"source": uri, "allowedNamespaces": [TENANT]}})
    cluster.create("modelcaches", demand("placement-intruder", uri, [INTRUDER]))
    cluster.create("modelcaches", demand("placement-secret", f"file://{secret}/", [TENANT]))
    cluster.create("modelcaches", demand("placement-nobody", uri, None))
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE},
                           config={"kubeletDir": str(kubelet)})
    try:
        seen = await eventually(lambda: (p := phases(cluster)) and len(p) == 3 and p, timeout=20,
                                what="the node's report of the three demands")
        for name in ("placement-intruder", "placement-secret", "placement-nobody"):
            assert seen[name][0] == "Failed" and "refused by policy" in seen[name][1], seen[name]
        assert INTRUDER in seen["placement-intruder"][1]
        assert "never models" in seen["placement-secret"][1]
        store = Store(d.root)
        assert store.list() == [], "nothing refused was fetched"
        assert not any("token" in p.name for p in (d.root / "blobs").rglob("*")), "the secret never reached the store"

        # the same demand once a namespace that may have the model asked for it: fetched and pinned
        cluster.patch("modelcaches", "placement-intruder", {"spec": {"demandNamespaces": [INTRUDER, TENANT]}},
                      "application/merge-patch+json")
        await eventually(lambda: phases(cluster).get("placement-intruder", ("",))[0] == "Ready", timeout=20,
                         what="the demand of an allowed namespace")
        await eventually(lambda: [i for i in Store(d.root).list() if i.pinned], what="the daemon's pin")
    finally:
        await d.daemon.stop()


async def test_a_snapshot_id_does_not_widen_a_glob_grant(cluster: FakeApiServer, short_dir: Path,
                                                          model_copy: Path) -> None:
    uri = f"file://{model_copy}/"
    cluster.create("modelcaches", {"metadata": {"name": "json-only"},
                                   "spec": {"source": uri, "include": ["*.json"], "allowedNamespaces": [TENANT]}})
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE})
    try:
        await eventually(lambda: d.daemon.node.ready().get("modelcaches_synced"), what="the ModelCache watch")
        full = await eventually(lambda: d.client.ensure(uri), what="the admin's full fetch")  # another tenant's
        full_id = full["snapshot"]["id"] if "snapshot" in full else full["id"]
        async with d.http() as http:
            body = {"uri": uri, "revision": full_id, "include": ["*.json"], "namespace": TENANT}
            async with http.put("/v1/models?wait=1", json=body) as r:
                lines = [json.loads(line) for line in (await r.read()).splitlines() if line.strip()]
        last = lines[-1] if lines else {}
        served = last.get("snapshot") or {}
        assert served.get("id") != full_id, "the snapshot id handed the whole snapshot to a *.json grant"
        if served:  # it may fetch the granted files as their own snapshot; it never serves the others
            files = os.listdir(served["path"])
            assert files and all(f.endswith(".json") for f in files), files
    finally:
        await d.daemon.stop()
