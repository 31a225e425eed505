"""End to end on one node: the webhook process (`weightcache webhook --controller` wiring) gates a pod, the
controller asks the node, a real daemon fetches the model and labels its node, the pod is released with the
required affinity; deleting the pod drops the demand; the label stays while the snapshot does and goes
with its eviction."""

from __future__ import annotations

import asyncio
from pathlib import Path

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_k8s_schema import validate_strict
from tests.fixtures_kube import NODE
from tests.fixtures_webhook import admission_review, apply_response, deployment_pod
from weightcache.placement import choice
from weightcache.uri import parse_ref
from weightcache.webhook.command import _policy
from weightcache.webhook.mutate import review

NS = "inference"


async def test_gated_pod_waits_for_a_real_daemon_then_lands_on_its_node(cluster: FakeApiServer, short_dir: Path,
                                                                        model_copy: Path) -> None:
    uri = f"file://{model_copy}/"
    ref = parse_ref(uri)
    # A grant only (no nodeSelector): nothing is prefetched until a pod asks.
    cluster.create("modelcaches", {"metadata": {"name": "grant"}, "spec": {"source": uri, "allowedNamespaces": [NS]}})
    policy, stop = _policy(None, controller=True)
    try:
        await eventually(lambda: policy.nodes() and policy.synced(), what="the webhook's view of nodes")
        pod = deployment_pod({"weightcache.io/model": uri})
        pod["metadata"]["name"] = "llama-0"
        answer = review(admission_review(pod), model_caches=policy.model_caches(),
                        allow_undeclared=policy.allow_undeclared, nodes=policy.nodes())
        assert answer["response"]["allowed"], answer
        cluster.create("pods", apply_response(pod, answer), NS)
        assert choice.gated(cluster.get("pods", "llama-0", NS))

        d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE}, config={"diskBudget": "1Gi"})
        try:
            await eventually(lambda: not choice.gated(cluster.get("pods", "llama-0", NS)), timeout=30,
                             what="the pod's release")
            labels = cluster.get("nodes", NODE)["metadata"]["labels"]
            assert labels.get(ref.label_key) == "ready", "released before its node was ready"
            demand = choice.demand_name(ref)
            assert cluster.get("modelcaches", demand)["spec"]["nodeNames"] == [NODE]
            status = cluster.get("modelcachenodes", NODE)["status"]
            assert status["models"][demand]["phase"] == "Ready"
            assert status["diskBudgetBytes"] == 2**30, "the budget placement keeps within"
            released = cluster.get("pods", "llama-0", NS)
            validate_strict(released)
            assert released["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]

            cluster.delete("pods", "llama-0", NS)
            await eventually(lambda: not [m for m in cluster.list("modelcaches") if m["metadata"]["name"] == demand],
                             what="the demand to go with the pod")
            # the snapshot stays on the node, and so does its label: the next pod of the model is never gated
            await eventually(lambda: not d.daemon.node.store.list()[0].pinned, what="the daemon's pin to go")
            assert cluster.get("nodes", NODE)["metadata"]["labels"].get(ref.label_key) == "ready"
            await asyncio.to_thread(d.daemon.node.store.evict, d.daemon.node.store.list()[0].snapshot.id)
            d.daemon.node.kick()
            await eventually(lambda: ref.label_key not in cluster.get("nodes", NODE)["metadata"]["labels"],
                             what="the daemon to take its label back once the snapshot is evicted")
        finally:
            await d.daemon.stop()
    finally:
        stop()


async def test_memory_nodes_put_the_model_in_the_ram_tier_of_the_picked_node(cluster: FakeApiServer,
                                                                             short_dir: Path,
                                                                             model_copy: Path) -> None:
    uri = f"file://{model_copy}/"
    cluster.create("modelcaches", {"metadata": {"name": "llama"}, "spec": {
        "source": uri, "nodeSelector": {"pool": "a100"}, "allowedNamespaces": [NS], "memory": {"nodes": 1}}})
    _, stop = _policy(None, controller=True)
    d = await start_daemon(short_dir, model_copy, env={"NODE_NAME": NODE}, config={"memoryBudget": "64Mi"})
    try:
        tier = d.daemon.node.tier
        assert tier is not None
        await eventually(lambda: cluster.get("modelcaches", "llama").get("status", {}).get("memoryNodes") == [NODE],
                         timeout=30, what="the controller's pick")
        (info,) = await eventually(lambda: d.daemon.node.store.list(), what="the model on disk")
        await eventually(lambda: [r for r in tier.resident() if r.id == info.snapshot.id], timeout=30,
                         what="the model resident in the RAM tier")
    finally:
        await d.daemon.stop()
        stop()


def test_without_the_controller_the_webhook_never_gates(cluster: FakeApiServer) -> None:
    policy, stop = _policy(True, controller=False)
    try:
        assert policy.nodes() is None, "nobody would lift the gate"
        pod = deployment_pod({"weightcache.io/model": "s3://models/llama/"})
        patched = apply_response(pod, review(admission_review(pod), model_caches=[], allow_undeclared=True,
                                             nodes=policy.nodes()))
        assert "schedulingGates" not in patched["spec"]
    finally:
        stop()
