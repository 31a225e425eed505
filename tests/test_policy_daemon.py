"""The daemon API applies the same file:// rules: never a model overlapping the node's own directories, and a
pod's namespace never gets an undeclared host directory (real daemon on its Unix socket)."""

from __future__ import annotations

from tests.fixtures_daemon import RunningDaemon


async def test_file_models_over_the_store_or_undeclared_for_a_namespace_are_refused(daemon: RunningDaemon) -> None:
    async with daemon.http() as http:
        for uri in (f"file://{daemon.root}/", f"file://{daemon.root}/snapshots/", "file:///proc/1/"):
            async with http.put("/v1/models", json={"uri": uri}) as r:
                answer = await r.json()
                assert r.status == 403, answer
                assert "never models" in answer["message"]
        async with http.put("/v1/models", json={"uri": daemon.model_uri, "namespace": "ml"}) as r:
            answer = await r.json()
            assert r.status == 403 and "allowUndeclaredModels does not apply" in answer["message"]
        async with http.put("/v1/models?wait=1", json={"uri": daemon.model_uri}) as r:  # the node's admin may
            assert r.status == 200 and b'"snapshot"' in await r.read()
