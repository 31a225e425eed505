"""The mutation as a pure function, on pods built the way the API server sends them."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tests.fixtures_webhook import (
    DRAFT,
    REF,
    admission_review,
    apply_response,
    check_pod,
    container,
    deployment_pod,
    envs,
)
from weightcache.errors import BadAdmissionReviewError
from weightcache.pods.annotations import MAX_MODELS
from weightcache.policy import CacheIndex
from weightcache.uri import readiness_label
from weightcache.webhook.mutate import review

OPEN = {"model_caches": [], "allow_undeclared": True}
PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
REQUIRED = "requiredDuringSchedulingIgnoredDuringExecution"


def admit(pod: dict[str, Any], **policy: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """(response, patched pod) for one review; the patched pod passes the API server's checks."""
    req = admission_review(pod)
    answer = review(req, **(policy or OPEN))
    assert answer["apiVersion"] == "admission.k8s.io/v1" and answer["kind"] == "AdmissionReview"
    assert answer["response"]["uid"] == req["request"]["uid"]
    patched = apply_response(pod, answer)
    if answer["response"]["allowed"]:
        check_pod(patched)
    return answer["response"], patched


def test_pod_without_annotations_is_allowed_unchanged() -> None:
    pod = deployment_pod({"prometheus.io/scrape": "true"})
    response, patched = admit(pod)
    assert response == {"uid": response["uid"], "allowed": True}
    assert patched == pod


def test_one_model_gets_volume_mount_env_and_preferred_affinity() -> None:
    pod = deployment_pod(
        {"weightcache.io/model": REF},
        containers=[container("server"), container("metrics", image="prom/exporter")],
        init_containers=[container("fetch-config", image="busybox")],
    )
    check_pod(pod)
    response, patched = admit(pod)
    assert response["allowed"] and response["patchType"] == "JSONPatch"
    spec = patched["spec"]
    volume = next(v for v in spec["volumes"] if v["name"] == "wc-model")
    assert volume == {
        "name": "wc-model",
        "csi": {
            "driver": "csi.weightcache.io",
            "readOnly": True,
            "volumeAttributes": {"model": "s3://models/llama-3-8b/", "revision": "", "tier": "disk"},
        },
    }
    assert spec["volumes"][:-1] == pod["spec"]["volumes"], "existing volumes are kept, in order"
    for c in spec["containers"]:
        assert {"name": "wc-model", "mountPath": "/models/model", "readOnly": True} in c["volumeMounts"]
        assert envs(c)["WEIGHTCACHE_MODEL_PATH"] == "/models/model"
        assert c["volumeMounts"][0]["name"] == "kube-api-access-7xq2p"
    assert spec["initContainers"] == pod["spec"]["initContainers"], "init containers are left alone by default"
    assert spec["affinity"]["nodeAffinity"] == {
        PREFERRED: [
            {
                "weight": 50,
                "preference": {
                    "matchExpressions": [{"key": readiness_label(REF), "operator": "In", "values": ["ready"]}]
                },
            }
        ]
    }
    assert patched["metadata"] == pod["metadata"] and "name" not in patched["metadata"]


def test_several_models_chosen_containers_base_path_memory_tier() -> None:
    sidecar = container("loader", image="loader:1", restartPolicy="Always")  # a native sidecar
    pod = deployment_pod(
        {
            "weightcache.io/models": f" llama={REF} , llama-draft={DRAFT}",
            "weightcache.io/mount-path": "/weights/",
            "weightcache.io/containers": "loader,server",
            "weightcache.io/tier": "memory",
        },
        containers=[container("server"), container("proxy", image="envoy")],
        init_containers=[sidecar],
    )
    _, patched = admit(pod)
    spec = patched["spec"]
    attrs = {v["name"]: v["csi"]["volumeAttributes"] for v in spec["volumes"] if "csi" in v}
    assert attrs == {
        "wc-llama": {"model": "s3://models/llama-3-8b/", "revision": "", "tier": "memory"},
        "wc-llama-draft": {"model": "s3://models/llama-draft/", "revision": "v2", "tier": "memory"},
    }
    server, proxy = spec["containers"]
    for c in (server, spec["initContainers"][0]):
        assert envs(c) == {
            "WEIGHTCACHE_MODEL_PATH_LLAMA": "/weights/llama",
            "WEIGHTCACHE_MODEL_PATH_LLAMA_DRAFT": "/weights/llama-draft",
        }
        assert [m["mountPath"] for m in c["volumeMounts"][1:]] == ["/weights/llama", "/weights/llama-draft"]
    assert proxy == pod["spec"]["containers"][1]
    keys = [t["preference"]["matchExpressions"][0]["key"] for t in spec["affinity"]["nodeAffinity"][PREFERRED]]
    assert keys == [readiness_label(REF), readiness_label(DRAFT)]


def test_require_cached_is_anded_into_every_existing_term_and_keeps_other_affinity() -> None:
    gpu = {"key": "nvidia.com/gpu.product", "operator": "In", "values": ["H100"]}
    zone = {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["a"]}
    anti = {
        "requiredDuringSchedulingIgnoredDuringExecution": [
            {"labelSelector": {"matchLabels": {"app": "llama"}}, "topologyKey": "kubernetes.io/hostname"}
        ]
    }
    affinity = {
        "nodeAffinity": {
            REQUIRED: {
                "nodeSelectorTerms": [
                    {"matchExpressions": [gpu]},
                    {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["node-7"]}]},
                ]
            },
            PREFERRED: [{"weight": 10, "preference": {"matchExpressions": [zone]}}],
        },
        "podAntiAffinity": anti,
    }
    pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/require-cached": "true"}, affinity=affinity)
    _, patched = admit(pod)
    ready = {"key": readiness_label(REF), "operator": "In", "values": ["ready"]}
    node = patched["spec"]["affinity"]["nodeAffinity"]
    assert node[REQUIRED]["nodeSelectorTerms"] == [
        {"matchExpressions": [gpu, ready]},
        {
            "matchFields": affinity["nodeAffinity"][REQUIRED]["nodeSelectorTerms"][1]["matchFields"],
            "matchExpressions": [ready],
        },
    ]
    assert node[PREFERRED] == affinity["nodeAffinity"][PREFERRED], "require-cached adds no preference"
    assert patched["spec"]["affinity"]["podAntiAffinity"] == anti


@pytest.mark.parametrize(
    "affinity", [None, {}, {"nodeAffinity": {}}, {"nodeAffinity": {REQUIRED: {"nodeSelectorTerms": []}}}]
)
def test_require_cached_builds_missing_affinity(affinity: dict[str, Any] | None) -> None:
    pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/require-cached": "true"}, affinity=affinity)
    _, patched = admit(pod)
    terms = patched["spec"]["affinity"]["nodeAffinity"][REQUIRED]["nodeSelectorTerms"]
    assert terms == [{"matchExpressions": [{"key": readiness_label(REF), "operator": "In", "values": ["ready"]}]}]


@pytest.mark.parametrize(
    "annotations",
    [
        {"weightcache.io/model": REF},
        {"weightcache.io/models": f"a={REF},b={DRAFT}", "weightcache.io/require-cached": "true"},
        {"weightcache.io/model": REF, "weightcache.io/containers": "server,warmup"},
    ],
)
def test_reinvocation_on_own_output_adds_nothing(annotations: dict[str, str]) -> None:
    pod = deployment_pod(
        annotations,
        init_containers=[container("warmup")],
        affinity={
            "nodeAffinity": {
                REQUIRED: {"nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "Exists"}]}]}
            }
        },
    )
    _, once = admit(pod)
    response, twice = admit(once)
    assert response == {"uid": response["uid"], "allowed": True}
    assert twice == once


def test_dry_run_is_answered_like_a_real_create() -> None:
    pod = deployment_pod({"weightcache.io/model": REF})
    real = review(admission_review(pod), **OPEN)["response"]
    dry = review(admission_review(pod, dry_run=True), **OPEN)["response"]
    assert dry["patch"] == real["patch"]


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda p: p["spec"]["volumes"].append({"name": "wc-model", "emptyDir": {}}), "wc-model"),
        (
            lambda p: p["spec"]["containers"][0]["volumeMounts"].append(
                {"name": "kube-api-access-7xq2p", "mountPath": "/models/model"}
            ),
            "/models/model",
        ),
        (
            lambda p: p["spec"]["containers"][0].update(env=[{"name": "WEIGHTCACHE_MODEL_PATH", "value": "/x"}]),
            "WEIGHTCACHE_MODEL_PATH",
        ),
    ],
)
def test_user_object_using_an_injected_name_is_denied_naming_it(change: Any, named: str) -> None:
    pod = deployment_pod({"weightcache.io/model": REF})
    change(pod)
    response, _ = admit(pod)
    assert response["allowed"] is False and "patch" not in response
    assert response["status"]["code"] == 409
    assert named in response["status"]["message"] and "rename" in response["status"]["message"]


@pytest.mark.parametrize(
    ("annotations", "hint"),
    [
        ({"weightcache.io/model": "models/llama"}, "s3://models/llama-3-8b/"),
        ({"weightcache.io/model": "s3://user:pw@host/x/"}, "environment"),
        ({"weightcache.io/models": f"a={REF},a={DRAFT}"}, "names 'a' twice"),
        ({"weightcache.io/models": f"Llama_3={REF}"}, "DNS label"),
        ({"weightcache.io/models": f"{'x' * 61}={REF}"}, "at most 60"),
        ({"weightcache.io/models": REF}, "<name>=<ref>"),
        ({"weightcache.io/models": " , "}, 'weightcache.io/models: "llama='),
        ({"weightcache.io/model": REF, "weightcache.io/models": f"a={REF}"}, "not both"),
        ({"weightcache.io/model": REF, "weightcache.io/tier": "ssd"}, "weightcache.io/tier: disk"),
        ({"weightcache.io/model": REF, "weightcache.io/require-cached": "yes"}, 'require-cached: "true"'),
        ({"weightcache.io/model": REF, "weightcache.io/mount-path": "models"}, "mount-path: /models/llama"),
        ({"weightcache.io/model": REF, "weightcache.io/mount-path": "/a/../etc"}, "without '..'"),
        ({"weightcache.io/model": REF, "weightcache.io/containers": "server,ghost"}, "write one or more of: server"),
    ],
)
def test_malformed_annotation_is_denied_with_what_to_write(annotations: dict[str, str], hint: str) -> None:
    response, _ = admit(deployment_pod(annotations))
    assert response["allowed"] is False and "patch" not in response
    assert response["status"]["code"] == 400
    assert hint in response["status"]["message"]
    assert "pw" not in response["status"]["message"], "credentials never reach messages"


def model_cache(source: str, namespaces: list[str]) -> dict[str, Any]:
    return {
        "apiVersion": "weightcache.io/v1alpha1",
        "kind": "ModelCache",
        "metadata": {"name": "llama"},
        "spec": {"source": source, "allowedNamespaces": namespaces},
    }


def test_policy_decides_per_namespace() -> None:
    pod = deployment_pod({"weightcache.io/models": f"a={REF},b={DRAFT}"})
    caches = [model_cache("s3://models/llama-3-8b", ["inference"]), model_cache("s3://models/llama-draft/", ["*"])]
    response, _ = admit(pod, model_caches=caches, allow_undeclared=False)
    assert response["allowed"] is True

    denied, _ = admit(pod, model_caches=caches[:1], allow_undeclared=False)
    assert denied["allowed"] is False and denied["status"]["code"] == 403
    assert (
        "model 'b'" in denied["status"]["message"]
        and "spec.allowedNamespaces: [inference]" in denied["status"]["message"]
    )

    other, _ = admit(pod, model_caches=[model_cache(REF, ["research"]), caches[1]], allow_undeclared=True)
    assert other["allowed"] is False and "'inference' is not in" in other["status"]["message"]


def bad(**changes: Any) -> dict[str, Any]:
    body = admission_review(deployment_pod({"weightcache.io/model": REF}))
    for key, value in changes.items():
        target = body if key.startswith("review_") else body["request"]
        key = key.removeprefix("review_")
        if value is None:
            target.pop(key)
        else:
            target[key] = value
    return body


@pytest.mark.parametrize(
    ("body", "says"),
    [
        (None, "not an AdmissionReview"),
        ([1, 2], "not an AdmissionReview"),
        (bad(review_apiVersion="admission.k8s.io/v1beta1"), "admissionReviewVersions: [v1]"),
        (bad(review_kind="Pod"), "not an AdmissionReview"),
        (bad(uid=None), "request.uid"),
        (bad(operation="UPDATE"), "Pod CREATE"),
        (bad(kind={"group": "apps", "version": "v1", "kind": "Deployment"}), "Pod CREATE"),
        (bad(subResource="ephemeralcontainers"), "Pod CREATE"),
        (bad(object=None), "request.object"),
        (
            bad(object={"metadata": {"annotations": {"weightcache.io/model": REF}}, "spec": {"containers": "x"}}),
            "'containers' must be a list",
        ),
        (bad(object={"metadata": {"annotations": "x"}}), "'annotations' must be an object"),
    ],
)
def test_not_a_pod_create_review_raises_bad_review(body: Any, says: str) -> None:
    with pytest.raises(BadAdmissionReviewError) as info:
        review(copy.deepcopy(body), **OPEN)
    assert says in str(info.value)


def test_models_per_pod_are_capped_before_parsing_and_the_cap_is_configurable() -> None:
    """Hardening III: a review cost O(models); past the cap it is a denial naming the cap and the flag."""
    names = ",".join(f"n{i}=s3://models/m{i}/" for i in range(MAX_MODELS + 1))
    request = admission_review(deployment_pod({"weightcache.io/models": names}))
    answer = review(request, model_caches=[], allow_undeclared=True)["response"]
    assert answer["allowed"] is False and "the webhook's --max-models" in answer["status"]["message"]
    assert review(request, model_caches=[], allow_undeclared=True, max_models=MAX_MODELS + 1)["response"]["allowed"]
    bad_refs = ",".join(f"n{i}=gopher://x/" for i in range(MAX_MODELS + 1))  # refused for the count, unparsed
    answer = review(admission_review(deployment_pod({"weightcache.io/models": bad_refs})), model_caches=[],
                    allow_undeclared=True)["response"]
    assert "at most 16" in answer["status"]["message"] and "gopher" not in answer["status"]["message"]


def test_a_cache_index_decides_as_the_list_does() -> None:
    """policy.CacheIndex (built once per change of the list) gives the same answers as the ModelCache objects."""
    caches = [
        {"metadata": {"name": "other"}, "spec": {"source": "s3://models/other/", "allowedNamespaces": ["*"]}},
        {"metadata": {"name": "narrow"}, "spec": {"source": REF, "allowedNamespaces": ["inference"],
                                                   "include": ["*.json"]}},
        {"metadata": {"name": "wide"}, "spec": {"source": REF, "allowedNamespaces": ["inference"]}},
        {"metadata": {"name": "elsewhere"}, "spec": {"source": REF, "allowedNamespaces": ["team-b"]}},
    ]
    for wanted in ({"weightcache.io/model": REF}, {"weightcache.io/model": "s3://models/undeclared/"}):
        for namespace in ("inference", "team-b", "team-c"):
            request = admission_review(deployment_pod(wanted), namespace=namespace)
            assert (review(request, model_caches=CacheIndex(caches), allow_undeclared=False)
                    == review(request, model_caches=caches, allow_undeclared=False))


def test_adapters_annotation_adds_the_base_models_adapter_directory_once() -> None:
    pod = deployment_pod({"weightcache.io/model": f"{REF}@abc123", "weightcache.io/adapters": "true"})
    response, patched = admit(pod)
    assert response["allowed"]
    spec = patched["spec"]
    assert next(v for v in spec["volumes"] if v["name"] == "wc-adapters") == {
        "name": "wc-adapters", "csi": {"driver": "csi.weightcache.io", "readOnly": True, "volumeAttributes": {
            "model": "s3://models/llama-3-8b/", "adapters": "true"}}}
    for c in spec["containers"]:
        assert {"name": "wc-adapters", "mountPath": "/models/adapters", "readOnly": True} in c["volumeMounts"]
        assert envs(c)["WEIGHTCACHE_ADAPTERS_PATH"] == "/models/adapters"
    again, twice = admit(patched)
    assert again == {"uid": again["uid"], "allowed": True} and twice == patched
    response, _ = admit(deployment_pod({"weightcache.io/models": f"a={REF},b={DRAFT}",
                                        "weightcache.io/adapters": "true"}))
    assert not response["allowed"] and "is for a pod of one model" in response["status"]["message"]
