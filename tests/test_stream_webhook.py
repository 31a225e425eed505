"""`weightcache.io/stream` in the webhook (docs/streaming-pods.md, "Gating and placement"): every model volume of a
streaming pod carries the volume attribute `stream: "true"` (the engine cache's does not), the pod is never gated
and gets no required affinity (placement prefer, whatever the webhook sees of the nodes), and what a growing view
cannot serve is refused with a line to paste: gate, require, hf-repo, tier memory, DRA."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures_k8s_schema import validate_strict
from tests.fixtures_webhook import DRAFT, REF, admission_review, apply_response, check_pod, container, deployment_pod
from weightcache.placement.nodes import NodeFacts
from weightcache.pods.annotations import ENGINE_CACHE, MODEL, MODELS, STREAM
from weightcache.uri import readiness_label
from weightcache.vocabulary import GATE, STREAM_ANNOTATION, STREAM_ATTRIBUTE
from weightcache.webhook.mutate import review

OPEN = {"model_caches": [], "allow_undeclared": True}
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"
COLD = [NodeFacts("a", {}, (), False, 8, 0), NodeFacts("b", {"pool": "h100"}, (), False, 8, 0)]  # ready nowhere


def admit(annotations: dict[str, str], nodes: list[NodeFacts] | None = None,
          **pod: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(response, patched pod); an allowed pod passes the API server's checks (strict v1.30 Pod schema; a DRA
    pod's claims, the strict v1.34 one, as tests/test_dra_webhook.py checks)."""
    p = deployment_pod(annotations, **pod)
    answer = review(admission_review(p), nodes=nodes, **OPEN)
    patched = apply_response(p, answer)
    if answer["response"]["allowed"]:
        if annotations.get("weightcache.io/via") == "dra":
            validate_strict(patched, "1.34")
        else:
            check_pod(patched)
    return answer["response"], patched


def csi_attributes(pod: dict[str, Any]) -> dict[str, dict[str, str]]:
    return {v["name"]: v["csi"]["volumeAttributes"] for v in pod["spec"]["volumes"] if "csi" in v}


def test_the_annotation_is_the_vocabulary_s() -> None:
    assert STREAM == STREAM_ANNOTATION == "weightcache.io/stream" and STREAM_ATTRIBUTE == "stream"


def test_every_model_volume_streams_and_the_engine_cache_volume_does_not() -> None:
    response, pod = admit({MODEL: REF, STREAM: "true", ENGINE_CACHE: "vllm-0.32.0-cpu"})
    assert response["allowed"] and "warnings" not in response, response  # a known key: no typo warning
    attributes = csi_attributes(pod)
    assert attributes["wc-model"] == {"model": REF, "revision": "", "tier": "disk", STREAM_ATTRIBUTE: "true"}
    assert STREAM_ATTRIBUTE not in attributes["wc-engine-cache"], attributes
    assert attributes["wc-engine-cache"]["engineCache"] == "vllm-0.32.0-cpu"

    _, several = admit({MODELS: f"llama={REF},draft={DRAFT}", STREAM: "True"},
                       containers=[container("server"), container("warmup")])
    assert {name: a.get(STREAM_ATTRIBUTE) for name, a in csi_attributes(several).items()} == {
        "wc-llama": "true", "wc-draft": "true"}
    # re-invocation on its own output adds nothing
    again = review(admission_review(several), **OPEN)["response"]
    assert again["allowed"] and "patch" not in again


@pytest.mark.parametrize("off", [{}, {STREAM: "false"}, {STREAM: " FALSE "}])
def test_without_stream_the_volumes_are_as_before(off: dict[str, str]) -> None:
    _, pod = admit({MODEL: REF, **off})
    assert csi_attributes(pod) == {"wc-model": {"model": REF, "revision": "", "tier": "disk"}}


@pytest.mark.parametrize("placement", [{}, {"weightcache.io/placement": "prefer"},
                                       {"weightcache.io/require-cached": "false"}])
def test_a_streaming_pod_whose_model_is_ready_nowhere_is_neither_gated_nor_required(
        placement: dict[str, str]) -> None:
    _, gated = admit({MODEL: REF}, COLD)
    assert gated["spec"]["schedulingGates"] == [{"name": GATE}], "without stream the default gates (docs/placement.md)"
    response, pod = admit({MODEL: REF, STREAM: "true", **placement}, COLD)
    assert response["allowed"], response
    assert "schedulingGates" not in pod["spec"], pod["spec"].get("schedulingGates")
    node = pod["spec"]["affinity"]["nodeAffinity"]
    assert REQUIRED not in node
    assert node[PREFERRED] == [{"weight": 50, "preference": {"matchExpressions": [
        {"key": readiness_label(REF), "operator": "In", "values": ["ready"]}]}}]


async def test_the_webhook_server_with_a_node_view_leaves_a_streaming_pod_ungated() -> None:
    """Through the HTTP app the shipped Deployment runs (`--controller`: it sees the nodes), not only the function."""
    from aiohttp.test_utils import TestClient, TestServer

    from weightcache.webhook.server import Policy, make_app

    policy = Policy(model_caches=list, allow_undeclared=True, nodes=lambda: COLD)
    async with TestClient(TestServer(make_app(policy))) as client:
        async def admitted(annotations: dict[str, str]) -> dict[str, Any]:
            body = admission_review(deployment_pod(annotations))
            reply = await client.post("/mutate", json=body)
            assert reply.status == 200
            patched = apply_response(body["request"]["object"], await reply.json())
            check_pod(patched)
            return patched

        assert (await admitted({MODEL: REF}))["spec"]["schedulingGates"] == [{"name": GATE}]
        streaming = await admitted({MODEL: REF, STREAM: "true"})
        assert "schedulingGates" not in streaming["spec"]
        assert list(streaming["spec"]["affinity"]["nodeAffinity"]) == [PREFERRED]
        assert csi_attributes(streaming)["wc-model"][STREAM_ATTRIBUTE] == "true"


def test_a_streaming_pod_keeps_its_own_required_affinity_untouched() -> None:
    gpu = {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": [
        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["h100"]}]}]}}}
    _, pod = admit({MODEL: REF, STREAM: "true"}, COLD, affinity=gpu)
    node = pod["spec"]["affinity"]["nodeAffinity"]
    assert node[REQUIRED] == gpu["nodeAffinity"][REQUIRED], "no readiness expression joins the pod's own terms"
    assert "schedulingGates" not in pod["spec"] and PREFERRED in node


@pytest.mark.parametrize(("extra", "names", "paste"), [
    ({"weightcache.io/placement": "gate"}, "weightcache.io/placement: gate", "weightcache.io/placement: prefer"),
    ({"weightcache.io/placement": "require"}, "weightcache.io/placement: require",
     "weightcache.io/placement: prefer"),
    ({"weightcache.io/require-cached": "true"}, 'weightcache.io/require-cached: "true"',
     'weightcache.io/require-cached: "false"'),
    ({"weightcache.io/hf-repo": "acme/llama"}, "weightcache.io/hf-repo", "whole snapshot"),
    ({"weightcache.io/tier": "memory"}, "weightcache.io/tier: memory", "weightcache.io/tier: disk"),
    ({"weightcache.io/via": "dra"}, "CSI-only for now", "weightcache.io/via: csi"),
    ({"weightcache.io/via": "dra-extended"}, "CSI-only for now", "weightcache.io/via: csi"),
])
@pytest.mark.parametrize("nodes", [None, COLD])
def test_what_streaming_cannot_go_with_is_refused_naming_both(extra: dict[str, str], names: str, paste: str,
                                                               nodes: list[NodeFacts] | None) -> None:
    allowed, _ = admit({MODEL: REF, **extra}, nodes)
    assert allowed["allowed"], "the same pod without stream is admitted"
    response, _ = admit({MODEL: REF, STREAM: "true", **extra}, nodes)
    assert response["allowed"] is False and "patch" not in response
    assert response["status"]["code"] == 400
    message = response["status"]["message"]
    assert 'weightcache.io/stream: "true"' in message and names in message and paste in message, message
    assert 'weightcache.io/stream: "false"' in message, "the other way out: wait for the whole model"


@pytest.mark.parametrize("value", ["yes", "1", ""])
def test_a_bad_stream_value_is_refused_with_the_line_to_paste(value: str) -> None:
    response, _ = admit({MODEL: REF, STREAM: value})
    assert response["allowed"] is False and response["status"]["code"] == 400
    message = response["status"]["message"]
    assert f"{STREAM} {value!r}" in message and f'write {STREAM}: "true"' in message, message
