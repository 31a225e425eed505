"""Annotation `weightcache.io/hf-repo`: the webhook asks the CSI volume for the hub cache layout and points
huggingface_hub at it (HF_HUB_CACHE = the mount, HF_HUB_OFFLINE=1); a bad repo id or several models is refused."""

from __future__ import annotations

from typing import Any

from tests.fixtures_webhook import REF, admission_review, apply_response, check_pod, deployment_pod, envs
from weightcache.webhook.mutate import review

OPEN = {"model_caches": [], "allow_undeclared": True}


def admit(annotations: dict[str, str]) -> tuple[dict[str, Any], dict[str, Any]]:
    pod = deployment_pod(annotations)
    answer = review(admission_review(pod), **OPEN)
    patched = apply_response(pod, answer)
    if answer["response"]["allowed"]:
        check_pod(patched)
    return answer["response"], patched


def test_hf_repo_sets_the_volume_attribute_and_hub_env() -> None:
    response, pod = admit({"weightcache.io/model": REF, "weightcache.io/hf-repo": "acme/llama"})
    assert response["allowed"]
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"].startswith("wc-")]
    assert volume["csi"]["volumeAttributes"]["hfRepo"] == "acme/llama"
    app = pod["spec"]["containers"][0]
    env = envs(app)
    mount = next(m for m in app["volumeMounts"] if m["name"] == volume["name"])
    assert env["HF_HUB_CACHE"] == mount["mountPath"] and env["HF_HUB_OFFLINE"] == "1"
    # re-invocation adds nothing twice
    again = review(admission_review(pod), **OPEN)
    assert again["response"]["allowed"] and "patch" not in again["response"]


def test_without_hf_repo_nothing_hub_related_is_injected() -> None:
    _, pod = admit({"weightcache.io/model": REF})
    assert all("HF_HUB_CACHE" not in envs(c) for c in pod["spec"]["containers"])
    assert all("hfRepo" not in v.get("csi", {}).get("volumeAttributes", {}) for v in pod["spec"]["volumes"])


def test_bad_hf_repo_is_refused_with_an_example() -> None:
    response, _ = admit({"weightcache.io/model": REF, "weightcache.io/hf-repo": "../../etc"})
    assert not response["allowed"]
    message = response["status"]["message"]
    assert "not a Hugging Face repo id" in message and "weightcache.io/hf-repo: meta-llama/" in message


def test_hf_repo_with_several_models_is_refused() -> None:
    response, _ = admit({"weightcache.io/models": f"a={REF}", "weightcache.io/hf-repo": "acme/llama"})
    assert not response["allowed"] and "applies to one model" in response["status"]["message"]
