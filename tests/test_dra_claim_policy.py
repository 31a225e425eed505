"""deploy/dra/claim-policy.yaml, evaluated as the API server would (cel-python, once per ModelCache param, the runs
ANDed): only namespaces a ModelCache grants may create ResourceClaims or ResourceClaimTemplates for a model's
devices, so a refused namespace cannot take the model's slots from the tenants it is granted to; claims for other
devices are untouched. The words are NodePrepare's (weightcache.policy.decide)."""

from __future__ import annotations

import copy
import subprocess
from pathlib import Path
from typing import Any

import celpy
import pytest
import yaml
from celpy.adapter import json_to_cel
from celpy.evaluation import CELEvalError

from tests.fixtures_crd_cel import cel_eval
from tests.fixtures_dra import cel_device
from tests.fixtures_k8s_schema import has_schema, validate_strict
from tests.tools import kubectl
from weightcache.dra.admission import MODEL_KEY_LABEL, main, model_key_label
from weightcache.dra.devices import devices_for
from weightcache.dra.template import claim_template
from weightcache.policy import decide
from weightcache.store import Snapshot
from weightcache.uri import parse_ref

ROOT = Path(__file__).resolve().parent.parent
POLICY = "weightcache-model-claims"
LLAMA = "s3://models/llama-3-8b/"
MISTRAL = "s3://models/mistral-7b/"



@pytest.fixture(scope="module")
def shipped() -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy" / "dra")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d and d["metadata"]["name"] == POLICY]


@pytest.fixture(scope="module")
def policy(shipped: list[dict[str, Any]]) -> dict[str, Any]:
    [found] = [o for o in shipped if o["kind"] == "ValidatingAdmissionPolicy"]
    return found


def modelcache(name: str, source: str, allowed: list[str] | None, *, label: bool = True) -> dict[str, Any]:
    spec: dict[str, Any] = {"source": source}
    if allowed is not None:
        spec["allowedNamespaces"] = allowed
    metadata: dict[str, Any] = {"name": name}
    if label:
        metadata["labels"] = {MODEL_KEY_LABEL: model_key_label(source)}
    return {"apiVersion": "weightcache.io/v1alpha1", "kind": "ModelCache", "metadata": metadata, "spec": spec}


FLEET = [modelcache("llama", LLAMA, ["ml"]), modelcache("mistral", MISTRAL, ["*"]),
         modelcache("llama-prefetch", LLAMA, None)]  # the placement controller's kind: grants nothing, refuses nothing


def template(source: str = LLAMA, namespace: str = "ml", **kwargs: Any) -> dict[str, Any]:
    return claim_template(source, namespace=namespace, **kwargs)


def claim(source: str = LLAMA, namespace: str = "ml", **kwargs: Any) -> dict[str, Any]:
    """The ResourceClaim kube-controller-manager makes from the template for a pod."""
    spec = template(source, namespace, **kwargs)["spec"]["spec"]
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "vllm-0-model-x7k2p", "namespace": namespace}, "spec": spec}


def gpu_claim(namespace: str) -> dict[str, Any]:
    return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
            "metadata": {"name": "gpu", "namespace": namespace},
            "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                "deviceClassName": "gpu.nvidia.com",
                "selectors": [{"cel": {"expression": 'device.attributes["gpu.nvidia.com"].productName == "H100"'}}],
                "allocationMode": "ExactCount", "count": 1}}]}}}


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    return cel_eval(expression, activation)


def _once(policy: dict[str, Any], obj: dict[str, Any], operation: str, params: dict[str, Any]) -> str | None:
    """One evaluation with one param: None when it passes, else the message."""
    kind = obj["kind"]
    activation: dict[str, Any] = {
        "request": json_to_cel({"operation": operation, "namespace": obj["metadata"]["namespace"],
                                "name": obj["metadata"]["name"],
                                "kind": {"group": "resource.k8s.io", "version": "v1", "kind": kind},
                                "resource": {"group": "resource.k8s.io", "version": "v1",
                                             "resource": kind.lower() + "s"}}),
        "object": json_to_cel(obj), "oldObject": None, "params": json_to_cel(params),
    }
    variables: dict[str, Any] = {}
    for var in policy["spec"]["variables"]:
        activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v
                                                          for k, v in variables.items()})
        value = _eval(var["expression"], activation)
        assert not isinstance(value, CELEvalError), (var["name"], value)
        variables[var["name"]] = value
    activation["variables"] = celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in variables.items()})
    for rule in policy["spec"]["validations"]:
        result = _eval(rule["expression"], activation)
        assert isinstance(result, celpy.celtypes.BoolType), (rule["expression"], result)
        if not result:
            assert rule["reason"] == "Forbidden"
            return str(_eval(rule["messageExpression"], activation))
    return None


def admit(policy: dict[str, Any], obj: dict[str, Any], modelcaches: list[dict[str, Any]] = FLEET,
          operation: str = "CREATE") -> tuple[bool, str]:
    """(allowed, message) as the API server decides: one evaluation per ModelCache, all must pass; none found is
    the binding's parameterNotFoundAction (Allow)."""
    for params in modelcaches:
        message = _once(policy, obj, operation, params)
        if message is not None:
            return False, message
    return True, "allowed"


def test_the_policy_and_binding_are_valid_for_1_34(shipped: list[dict[str, Any]]) -> None:
    assert {o["kind"] for o in shipped} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    for obj in shipped:
        assert has_schema(obj, "1.34")
        validate_strict(obj, "1.34")
    [binding] = [o for o in shipped if o["kind"] == "ValidatingAdmissionPolicyBinding"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert binding["spec"]["paramRef"] == {"selector": {}, "parameterNotFoundAction": "Allow"}  # every ModelCache


def test_the_policy_matches_the_claim_kinds_the_driver_targets(policy: dict[str, Any]) -> None:
    [rule] = policy["spec"]["matchConstraints"]["resourceRules"]
    assert rule["apiVersions"] == [claim()["apiVersion"].partition("/")[2]]  # the template's resource.k8s.io/v1
    assert set(rule["resources"]) == {"resourceclaims", "resourceclaimtemplates"}
    assert policy["spec"]["paramKind"] == {"apiVersion": "weightcache.io/v1alpha1", "kind": "ModelCache"}


@pytest.mark.parametrize("make", [claim, template])
def test_an_allowed_namespace_gets_its_claim(policy: dict[str, Any], make: Any) -> None:
    assert admit(policy, make(LLAMA, "ml")) == (True, "allowed")
    assert admit(policy, make(LLAMA, "ml", revision="v2", mount_path="/models/llama")) == (True, "allowed")
    assert admit(policy, make(MISTRAL, "anyone")) == (True, "allowed")  # allowedNamespaces: ["*"]
    older = make(LLAMA, "ml", revision="v2")  # written before the selector read `has(...revision)` first
    spec = older["spec"]["spec"] if older["kind"] == "ResourceClaimTemplate" else older["spec"]
    [first, *_] = spec["devices"]["requests"][0]["exactly"]["selectors"]
    assert "has(" in first["cel"]["expression"]
    first["cel"]["expression"] = first["cel"]["expression"].replace(
        'has(device.attributes["models.weightcache.io"].revision) && ', "")
    assert admit(policy, older) == (True, "allowed")
    assert not admit(policy, make(LLAMA, "intruder", revision="v2"))[0]


@pytest.mark.parametrize("make", [claim, template])
def test_a_refused_namespace_is_denied_in_nodeprepares_words(policy: dict[str, Any], make: Any) -> None:
    """The attack: claims from a namespace the ModelCache does not list would hold the model's slots."""
    allowed, message = admit(policy, make(LLAMA, "intruder"))
    assert not allowed
    words = decide(parse_ref(LLAMA), "intruder", [modelcache("llama", LLAMA, ["ml"])], allow_undeclared=False)
    assert not words.allowed and message == words.reason  # "...declared by ModelCache llama but namespace..."


def test_every_alternative_of_first_available_is_checked(policy: dict[str, Any]) -> None:
    obj = claim(LLAMA, "intruder")
    [request] = obj["spec"]["devices"]["requests"]
    decoy = {"name": "any-gpu", "deviceClassName": "gpu.nvidia.com"}
    obj["spec"]["devices"]["requests"] = [{"name": "model", "firstAvailable": [
        decoy, {"name": "llama", **request["exactly"]}]}]
    assert not admit(policy, obj)[0]


@pytest.mark.parametrize("selectors", [
    [],  # any model of the class
    [{"cel": {"expression": 'device.attributes["models.weightcache.io"].slot == 0'}}],
    [{"cel": {"expression": 'device.attributes["models.weightcache.io"].model == "m0123456789abcdef0123" || true'}}],
    [{"cel": {"expression": 'device.attributes["models.weightcache.io"].model == "m0123456789abcdef0123" '
                            '&& true ? true : true'}}],
    [{"cel": {"expression": 'device.attributes["models.weightcache.io"]["model"] == "m0123456789abcdef0123"'}}],
])
def test_a_claim_that_names_no_single_model_is_denied(policy: dict[str, Any], selectors: list[Any]) -> None:
    """Such a selector would let the scheduler hand out any model's slot, a refused one included."""
    obj = claim(LLAMA, "ml")
    obj["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = selectors
    allowed, message = admit(policy, obj)
    assert not allowed
    assert message.startswith("request model asks for models.weightcache.io devices without naming one model")
    assert "python -m weightcache.dra.template" in message


def test_a_selector_on_this_drivers_attributes_through_another_class_is_ours(policy: dict[str, Any]) -> None:
    obj = gpu_claim("intruder")
    obj["spec"]["devices"]["requests"][0]["exactly"]["selectors"] = [
        {"cel": {"expression": 'device.driver == "models.weightcache.io"'}}]
    assert not admit(policy, obj)[0]
    named = claim(LLAMA, "intruder")
    named["spec"]["devices"]["requests"][0]["exactly"]["deviceClassName"] = "gpu.nvidia.com"
    assert not admit(policy, named)[0]


def test_other_drivers_claims_are_untouched(policy: dict[str, Any]) -> None:
    assert admit(policy, gpu_claim("intruder")) == (True, "allowed")
    assert admit(policy, gpu_claim("intruder"), []) == (True, "allowed")
    empty = gpu_claim("intruder")
    del empty["spec"]["devices"]
    assert admit(policy, empty) == (True, "allowed")


def test_a_modelcache_without_the_label_or_grants_has_no_say(policy: dict[str, Any]) -> None:
    assert admit(policy, claim(LLAMA, "intruder"), [modelcache("llama", LLAMA, ["ml"], label=False)])[0]
    assert admit(policy, claim(LLAMA, "intruder"), [modelcache("llama-prefetch", LLAMA, None)])[0]
    assert admit(policy, claim(LLAMA, "intruder"), [modelcache("llama", LLAMA, [])])[0]


def test_a_modelcache_of_another_model_does_not_refuse(policy: dict[str, Any]) -> None:
    assert admit(policy, claim(MISTRAL, "intruder"), [modelcache("llama", LLAMA, ["ml"])])[0]


def test_update_is_checked_like_create(policy: dict[str, Any]) -> None:
    assert not admit(policy, template(LLAMA, "intruder"), operation="UPDATE")[0]


def test_the_label_is_the_key_the_devices_publish_and_the_claim_selects(tmp_path: Path,
                                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The allocation side and the policy agree: the claim the policy admits selects exactly that model's devices,
    whose `model` attribute is the ModelCache's label."""
    snapshots = [Snapshot("a" * 40, tmp_path, LLAMA, None, 1), Snapshot("b" * 40, tmp_path, MISTRAL, None, 1)]
    devices = devices_for(snapshots, slots=2, shared=False)
    selectors = claim(LLAMA)["spec"]["devices"]["requests"][0]["exactly"]["selectors"]  # the model, ready == true
    expressions = [s["cel"]["expression"] for s in selectors]
    chosen = [d for d in devices if all(cel_eval(e, {"device": cel_device(d)}) == celpy.celtypes.BoolType(True)
                                        for e in expressions)]
    assert [d["name"] for d in chosen] == [f"m-{'a' * 40}-0", f"m-{'a' * 40}-1"]
    assert {d["attributes"]["model"]["string"] for d in chosen} == {model_key_label(LLAMA)}
    assert model_key_label("s3://models/llama-3-8b") == model_key_label(LLAMA)  # the canonical source's key
    assert main([LLAMA]) == 0
    assert capsys.readouterr().out == f"{MODEL_KEY_LABEL}={model_key_label(LLAMA)}\n"


def test_a_hostile_claim_costs_only_itself(policy: dict[str, Any]) -> None:
    """Requests without exactly/firstAvailable, selectors without cel: evaluated, not an error."""
    obj = claim(LLAMA, "ml")
    obj["spec"]["devices"]["requests"].append({"name": "odd"})
    obj["spec"]["devices"]["requests"].append({"name": "odd2", "exactly": {"deviceClassName": "gpu.nvidia.com",
                                                                            "selectors": [{}]}})
    assert admit(policy, obj) == (True, "allowed")
    bad = copy.deepcopy(obj)
    bad["metadata"]["namespace"] = "intruder"
    assert not admit(policy, bad)[0]
