"""deploy/dra/slice-policy.yaml, evaluated as the API server would (cel-python): the daemon's ServiceAccount writes
only ResourceSlices of models.weightcache.io for the node its token is bound to; other users are not matched."""

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
from tests.tools import kubectl
from weightcache.dra.slices import build_slices

ROOT = Path(__file__).resolve().parent.parent
POLICY = "weightcache-daemon-own-slices"
DAEMON = "system:serviceaccount:weightcache:weightcache-daemon"
NODE_KEY = "authentication.kubernetes.io/node-name"


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    """The policy as `kubectl kustomize deploy/dra` ships it (skips without kubectl), with its binding checked."""
    done = subprocess.run([kubectl(), "kustomize", str(ROOT / "deploy" / "dra")], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    objs: list[dict[str, Any]] = [d for d in yaml.safe_load_all(done.stdout) if d]
    [binding] = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicyBinding" and o["metadata"]["name"] == POLICY]
    assert binding["spec"] == {"policyName": POLICY, "validationActions": ["Deny"]}
    [found] = [o for o in objs if o["kind"] == "ValidatingAdmissionPolicy" and o["metadata"]["name"] == POLICY]
    return found


def _eval(expression: str, activation: dict[str, Any]) -> Any:
    return cel_eval(expression, activation)


def _variables(values: dict[str, Any]) -> Any:
    """The `variables` map of values already in CEL types (json_to_cel would turn a BoolType into an IntType)."""
    return celpy.celtypes.MapType({celpy.celtypes.StringType(k): v for k, v in values.items()})


def admit(policy: dict[str, Any], operation: str, user: str, node: str | None,
          new: dict[str, Any] | None, old: dict[str, Any] | None) -> tuple[bool, str]:
    """(allowed, message) for one request: matchConditions, then variables in order, then every validation."""
    extra = {NODE_KEY: [node]} if node is not None else {}
    name = (new or old or {})["metadata"]["name"]
    activation: dict[str, Any] = {
        "request": json_to_cel({"operation": operation, "name": name,
                                      "userInfo": {"username": user, "extra": extra}}),
        "object": json_to_cel(new), "oldObject": json_to_cel(old),
    }
    if not all(bool(_eval(c["expression"], activation)) for c in policy["spec"]["matchConditions"]):
        return True, "not matched"
    variables: dict[str, Any] = {}
    for var in policy["spec"]["variables"]:
        activation["variables"] = _variables(variables)
        value = _eval(var["expression"], activation)
        assert not isinstance(value, CELEvalError), (var["name"], value)
        variables[var["name"]] = value
    activation["variables"] = _variables(variables)
    for rule in policy["spec"]["validations"]:
        result = _eval(rule["expression"], activation)
        assert isinstance(result, celpy.celtypes.BoolType), (rule["expression"], result)
        if not result:
            message = str(_eval(rule["messageExpression"], activation)) if "messageExpression" in rule \
                else rule["message"]
            assert rule["reason"] == "Forbidden"
            return False, message
    return True, "allowed"


def own(node: str = "node-a", **spec: Any) -> dict[str, Any]:
    """A slice exactly as the plugin publishes it for `node`, with `spec` fields overridden."""
    [obj] = build_slices(node, [], generation=1)
    obj["spec"].update(spec)
    return obj


def test_the_daemon_writes_its_own_nodes_slices(policy: dict[str, Any]) -> None:
    mine = own()
    assert admit(policy, "CREATE", DAEMON, "node-a", mine, None)[0]
    newer = copy.deepcopy(mine)
    newer["spec"]["pool"]["generation"] = 2
    assert admit(policy, "UPDATE", DAEMON, "node-a", newer, mine)[0]
    assert admit(policy, "DELETE", DAEMON, "node-a", None, mine)[0]


@pytest.mark.parametrize("operation", ["CREATE", "UPDATE", "DELETE"])
def test_another_nodes_slice_is_refused_naming_the_node(policy: dict[str, Any], operation: str) -> None:
    theirs = own("node-b")
    allowed, message = admit(policy, operation, DAEMON, "node-a",
                             None if operation == "DELETE" else theirs, None if operation == "CREATE" else theirs)
    assert not allowed
    assert "node-a" in message and theirs["metadata"]["name"] in message


@pytest.mark.parametrize("change", [
    {"driver": "gpu.nvidia.com"},  # another driver's devices on its own node
    {"pool": {"name": "node-b", "generation": 1, "resourceSliceCount": 1}},  # another node's pool
    {"nodeName": "node-b"},
])
def test_a_slice_that_is_not_this_drivers_own_pool_is_refused(policy: dict[str, Any], change: dict[str, Any]) -> None:
    assert not admit(policy, "CREATE", DAEMON, "node-a", own(**change), None)[0]
    assert not admit(policy, "UPDATE", DAEMON, "node-a", own(**change), own())[0]


def test_all_nodes_or_selector_slices_are_refused(policy: dict[str, Any]) -> None:
    everywhere = own()
    del everywhere["spec"]["nodeName"]
    everywhere["spec"]["allNodes"] = True
    assert not admit(policy, "CREATE", DAEMON, "node-a", everywhere, None)[0]


def test_taking_over_another_nodes_slice_by_update_is_refused(policy: dict[str, Any]) -> None:
    """Renaming a foreign slice's node to our own would delete the other node's devices."""
    assert not admit(policy, "UPDATE", DAEMON, "node-a", own("node-a"), own("node-b"))[0]
    assert not admit(policy, "UPDATE", DAEMON, "node-a", own(), own(driver="gpu.nvidia.com"))[0]


def test_a_token_without_a_node_name_writes_nothing(policy: dict[str, Any]) -> None:
    allowed, message = admit(policy, "CREATE", DAEMON, None, own(), None)
    assert not allowed and "node-name" in message


def test_the_daemon_account_is_matched_in_any_namespace_and_nobody_else(policy: dict[str, Any]) -> None:
    moved = "system:serviceaccount:models:weightcache-daemon"
    assert not admit(policy, "CREATE", moved, "node-a", own("node-b"), None)[0]
    for other in ("system:node:node-a", "system:serviceaccount:kube-system:gpu-driver", "alice"):
        assert admit(policy, "CREATE", other, "node-a", own("node-b"), None) == (True, "not matched")


def test_the_daemon_deletes_only_pods_on_its_own_node() -> None:
    """deploy/dra/rbac.yaml's pod policy: the delete right the taint eviction needs (weightcache/dra/eviction.py)
    reaches only pods bound to the node in the daemon's token."""
    docs = [d for d in yaml.safe_load_all((ROOT / "deploy" / "dra" / "rbac.yaml").read_text()) if d]
    name = "weightcache-daemon-own-node-pods"
    [pods] = [d for d in docs if d["kind"] == "ValidatingAdmissionPolicy" and d["metadata"]["name"] == name]
    assert any(d["kind"] == "ValidatingAdmissionPolicyBinding" and d["spec"]["policyName"] == name for d in docs)
    pod = {"metadata": {"name": "p", "namespace": "ml"}, "spec": {"nodeName": "node-a"}}
    assert admit(pods, "DELETE", DAEMON, "node-a", None, pod)[0]
    assert not admit(pods, "DELETE", DAEMON, "node-b", None, pod)[0]
    assert not admit(pods, "DELETE", DAEMON, None, None, pod)[0]  # a token bound to no node
    assert not admit(pods, "DELETE", DAEMON, "node-a", None, {"metadata": {"name": "p"}, "spec": {}})[0]  # unscheduled
    assert admit(pods, "DELETE", "system:serviceaccount:kube-system:deployment-controller", None, None, pod)[0]
