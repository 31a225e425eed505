"""The webhook's `weightcache.io/via: dra` branch: a pod asking for a model gets a ResourceClaim from the model's
template (pod.spec.resourceClaims + container resources.claims) instead of the CSI volume; the patched pod passes
the 1.34 Pod schema (strict), and the template the claim names is the one weightcache.dra.template renders."""

from __future__ import annotations

from typing import Any

import pytest

from tests.fixtures_k8s_schema import validate_strict
from tests.fixtures_webhook import DRAFT, REF, admission_review, apply_response, container, deployment_pod
from weightcache.dra.template import claim_template
from weightcache.webhook.mutate import review

OPEN = {"model_caches": [], "allow_undeclared": True}


def admit(pod: dict[str, Any], **policy: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    answer = review(admission_review(pod), **(policy or OPEN))
    patched = apply_response(pod, answer)
    if answer["response"]["allowed"]:
        validate_strict(patched, "1.34")
    return answer["response"], patched


def test_one_model_becomes_a_claim_from_its_template() -> None:
    response, pod = admit(deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra"}))
    assert response["allowed"]
    template = claim_template(REF)
    assert pod["spec"]["resourceClaims"] == [{"name": "wc-model",
                                              "resourceClaimTemplateName": template["metadata"]["name"]}]
    for c in pod["spec"]["containers"]:
        assert c["resources"]["claims"] == [{"name": "wc-model"}]
        assert "nvidia.com/gpu" in c["resources"]["limits"]  # the rest of resources is kept
    assert "volumes" not in pod["spec"] or all("csi" not in v for v in pod["spec"]["volumes"])
    assert "affinity" not in pod["spec"]  # the scheduler places the pod by the claim
    again, _ = admit(pod)  # reinvocation on its own output adds nothing
    assert "patch" not in again


def test_several_models_get_templates_with_their_paths_and_envs() -> None:
    models = f"llama={REF},draft={DRAFT}"
    response, pod = admit(deployment_pod({"weightcache.io/models": models, "weightcache.io/via": "dra"}))
    assert response["allowed"]
    names = {c["name"]: c["resourceClaimTemplateName"] for c in pod["spec"]["resourceClaims"]}
    expected = {"wc-llama": claim_template(REF, mount_path="/models/llama", env="WEIGHTCACHE_MODEL_PATH_LLAMA"),
                "wc-draft": claim_template(DRAFT, mount_path="/models/draft", env="WEIGHTCACHE_MODEL_PATH_DRAFT")}
    assert names == {k: t["metadata"]["name"] for k, t in expected.items()}
    assert expected["wc-llama"]["spec"]["spec"]["devices"]["config"][0]["opaque"]["parameters"] == {
        "mountPath": "/models/llama", "env": "WEIGHTCACHE_MODEL_PATH_LLAMA"}
    for template in expected.values():
        validate_strict(template, "1.34")


def test_gate_placement_still_gates() -> None:
    _, pod = admit(deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra",
                                   "weightcache.io/placement": "gate"}))
    assert pod["spec"]["schedulingGates"] == [{"name": "weightcache.io/model"}]


@pytest.mark.parametrize(("annotations", "says"), [
    ({"weightcache.io/via": "fuse"}, "weightcache.io/via: dra"),
    ({"weightcache.io/via": "dra", "weightcache.io/tier": "memory"}, "needs the CSI volume"),
])
def test_bad_via_or_tier_is_denied_with_what_to_write(annotations: dict[str, str], says: str) -> None:
    response, _ = admit(deployment_pod({"weightcache.io/model": REF, **annotations}))
    assert not response["allowed"] and response["status"]["code"] == 400
    assert says in response["status"]["message"]


def test_a_claim_name_already_used_differently_is_a_conflict() -> None:
    pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra"},
                         containers=[container("server")])
    pod["spec"]["resourceClaims"] = [{"name": "wc-model", "resourceClaimName": "mine"}]
    response, _ = admit(pod)
    assert not response["allowed"] and response["status"]["code"] == 409


def test_the_namespace_policy_applies_as_for_csi() -> None:
    caches = [{"metadata": {"name": "llama"}, "spec": {"source": REF, "allowedNamespaces": ["team-a"]}}]
    response, _ = admit(deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra"}),
                        model_caches=caches, allow_undeclared=False)
    assert not response["allowed"] and response["status"]["code"] == 403
