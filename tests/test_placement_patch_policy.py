"""deploy/daemonset/placement-patch-policy.yaml, evaluated as the API server would (cel-python): the webhook's
ServiceAccount may UPDATE a pod only in spec.schedulingGates and spec.affinity, which is what the placement
controller's release patch changes (the real patch, from the controller's own code, applied with jsonpatch);
images, env, volumes, labels and the rest are denied; other users are not matched."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import celpy
import jsonpatch
import pytest
import yaml
from celpy.adapter import json_to_cel

from tests.fixtures_crd_cel import cel_eval
from tests.fixtures_k8s_schema import has_schema, validate_strict
from tests.fixtures_webhook import container, deployment_pod
from tests.tools import kubectl
from weightcache.pods.patch import required_affinity
from weightcache.uri import readiness_label
from weightcache.vocabulary import GATE

ROOT = Path(__file__).resolve().parent.parent
POLICY = "weightcache-placement-pod-patches"
WEBHOOK_USER = "system:serviceaccount:{ns}:weightcache-webhook"
_SCHEMA_DEFS = "io.k8s.api.core.v1.PodSpec"


@pytest.fixture(scope="module")
def shipped() -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy" / "daemonset")], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d and d["metadata"]["name"] == POLICY]


@pytest.fixture(scope="module")
def policy(shipped: list[dict[str, Any]]) -> dict[str, Any]:
    [found] = [o for o in shipped if o["kind"] == "ValidatingAdmissionPolicy"]
    return found


def admit(policy: dict[str, Any], old: dict[str, Any], new: dict[str, Any], *, user: str | None = None,
          operation: str = "UPDATE") -> list[str]:
    """The messages of the failed validations; [] when allowed (or when the request is not matched)."""
    request = {"operation": operation, "namespace": old["metadata"]["namespace"],
               "resource": {"group": "", "version": "v1", "resource": "pods"},
               "userInfo": {"username": user or WEBHOOK_USER.format(ns="weightcache"),
                            "groups": ["system:serviceaccounts", "system:authenticated"]}}
    rules = policy["spec"]["matchConstraints"]["resourceRules"]
    if not any(operation in r["operations"] and "pods" in r["resources"] for r in rules):
        return []
    activation = {"request": json_to_cel(request), "object": json_to_cel(new), "oldObject": json_to_cel(old)}
    if not all(bool(cel_eval(c["expression"], activation)) for c in policy["spec"]["matchConditions"]):
        return []
    failed = []
    for rule in policy["spec"]["validations"]:
        result = cel_eval(rule["expression"], activation)
        assert isinstance(result, celpy.celtypes.BoolType), (rule["expression"][:80], result)
        if not result:
            assert rule["reason"] == "Forbidden"
            failed.append(rule["message"])
    return failed


def gated_pod() -> dict[str, Any]:
    pod = deployment_pod({"weightcache.io/model": "s3://models/llama-3-8b/"},
                         containers=[container("server", env=[{"name": "A", "value": "1"}]), container("sidecar")],
                         init_containers=[container("warmup", image="busybox:1.36")])
    pod["metadata"].update(name="llama-7d9f8c6b5-x2k4p", resourceVersion="812")
    pod["spec"]["schedulingGates"] = [{"name": "example.com/other"}, {"name": GATE}]
    pod["spec"]["nodeSelector"] = {"pool": "gpu"}
    pod["spec"]["affinity"] = {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [
        {"weight": 10, "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                           "labelSelector": {"matchLabels": {"app": "llama"}}}}]}}
    return pod


def released(pod: dict[str, Any]) -> dict[str, Any]:
    """The pod after the placement controller's release patch (placement/controller.py `_release`)."""
    i = next(i for i, g in enumerate(pod["spec"]["schedulingGates"]) if g["name"] == GATE)
    ops = [*required_affinity(pod["spec"], [readiness_label("s3://models/llama-3-8b/")]),
           {"op": "remove", "path": f"/spec/schedulingGates/{i}"}]
    new: dict[str, Any] = jsonpatch.apply_patch(pod, ops)
    new["metadata"]["resourceVersion"] = "813"  # what the API server changes itself
    new["metadata"]["managedFields"] = [{"manager": "weightcache", "operation": "Update"}]
    return new


def test_the_policy_and_binding_are_valid(shipped: list[dict[str, Any]]) -> None:
    assert {o["kind"] for o in shipped} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for version in ("1.30", "1.34"):
        for obj in shipped:
            assert has_schema(obj, version)
            validate_strict(obj, version)
    [binding] = [o for o in shipped if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    assert "- placement-patch-policy.yaml" in (ROOT / "deploy" / "daemonset" / "kustomization.yaml").read_text()


def test_the_release_patch_passes(policy: dict[str, Any]) -> None:
    pod = gated_pod()
    new = released(pod)
    assert new["spec"]["schedulingGates"] == [{"name": "example.com/other"}]
    assert new["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    validate_strict(new)
    assert admit(policy, pod, new) == []
    # the last gate: the controller's patch leaves an empty list; removing the list whole passes too
    pod["spec"]["schedulingGates"] = [{"name": GATE}]
    assert admit(policy, pod, released(pod)) == []
    bare = released(pod)
    del bare["spec"]["schedulingGates"], bare["spec"]["affinity"]
    assert admit(policy, pod, bare) == []


def _image(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["image"] = "attacker.example/miner:latest"


def _init_image(pod: dict[str, Any]) -> None:
    pod["spec"]["initContainers"][0]["image"] = "attacker.example/miner:latest"


def _volume(pod: dict[str, Any]) -> None:
    pod["spec"]["volumes"].append({"name": "host", "hostPath": {"path": "/"}})


def _env(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][1].setdefault("env", []).append({"name": "LD_PRELOAD", "value": "/tmp/x.so"})


def _env_changed(pod: dict[str, Any]) -> None:
    pod["spec"]["containers"][0]["env"][0]["value"] = "2"


def _ephemeral(pod: dict[str, Any]) -> None:
    pod["spec"]["ephemeralContainers"] = [{"name": "debug", "image": "busybox:1.36"}]


def _toleration(pod: dict[str, Any]) -> None:
    pod["spec"]["tolerations"].append({"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"})


def _node_selector(pod: dict[str, Any]) -> None:
    pod["spec"]["nodeSelector"]["kubernetes.io/hostname"] = "attacker-node"


def _node_selector_dropped(pod: dict[str, Any]) -> None:
    del pod["spec"]["nodeSelector"]


def _deadline(pod: dict[str, Any]) -> None:
    pod["spec"]["activeDeadlineSeconds"] = 1


def _label(pod: dict[str, Any]) -> None:
    pod["metadata"]["labels"]["app"] = "payments"  # steals another Service's traffic


def _annotation(pod: dict[str, Any]) -> None:
    pod["metadata"]["annotations"]["weightcache.io/model"] = "s3://attacker/model/"


def _owner(pod: dict[str, Any]) -> None:
    pod["metadata"]["ownerReferences"] = []


def _finalizer(pod: dict[str, Any]) -> None:
    pod["metadata"]["finalizers"] = ["example.com/never"]


@pytest.mark.parametrize("change", [_image, _init_image, _volume, _env, _env_changed, _ephemeral, _toleration,
                                    _node_selector, _node_selector_dropped, _deadline, _label, _annotation, _owner,
                                    _finalizer], ids=lambda f: f.__name__.strip("_"))
def test_any_other_change_is_denied_even_with_the_release(policy: dict[str, Any], change: Any) -> None:
    pod = gated_pod()
    alone = copy.deepcopy(pod)
    change(alone)
    with_release = released(pod)
    change(with_release)
    assert admit(policy, pod, alone), "denied alone"
    messages = admit(policy, pod, with_release)
    assert messages and all(m.startswith("weightcache-webhook may") for m in messages)


def test_other_users_and_other_operations_are_untouched(policy: dict[str, Any]) -> None:
    pod = gated_pod()
    new = copy.deepcopy(pod)
    _image(new)
    for user in ("system:serviceaccount:kube-system:replicaset-controller", "alice@example.com",
                 "system:serviceaccount:weightcache:weightcache-daemon",
                 "system:serviceaccount:other:weightcache-webhook"):
        assert admit(policy, pod, new, user=user) == []
    assert admit(policy, pod, new, operation="CREATE") == []
    assert admit(policy, pod, new) != []  # the same change by the webhook is denied


def test_every_pod_spec_field_of_the_floor_version_is_compared(policy: dict[str, Any]) -> None:
    """A field the policy forgot would be a field a stolen token could change: all of Kubernetes 1.30's PodSpec
    but the two the controller writes are named in the validations."""
    import json
    from importlib.resources import files

    defs = json.loads(files("kubernetes_validate").joinpath("kubernetes-json-schema", "v1.30.0-local-strict",
                                                            "_definitions.json").read_text())["$defs"]
    fields = set(defs[_SCHEMA_DEFS]["properties"]) - {"schedulingGates", "affinity"}
    text = " ".join(v["expression"] for v in policy["spec"]["validations"])
    missing = sorted(f for f in fields if f"object.spec.{f} ==" not in text)
    assert not missing
    assert "schedulingGates" not in text and "affinity" not in text
