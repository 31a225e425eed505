"""The stand-in API server refuses what a 1.36 API server refuses, one test per rule of tests/fake_rules.py (the
upstream source of each is named there and in docs/fake-apiserver.md), through the official client as the
project's code calls it."""

from __future__ import annotations

import json
from typing import Any

import kubernetes
import pytest

from tests.fake_apiserver import FakeApiServer
from tests.fake_rules import User, canonical_quantity, daemon_user, shipped_policies, shipped_rbac
from weightcache.dra import DRIVER_NAME
from weightcache.units import quantity

GROUP, V = "resource.k8s.io", "v1"


def _claim(api: FakeApiServer, node: str) -> dict[str, Any]:
    """A claim the scheduler allocated on `node` (a node-local pool: the node selector names it)."""
    api.create("resourceclaims", {"metadata": {"name": "c"}, "spec": {"devices": {"requests": [
        {"name": "model", "exactly": {"deviceClassName": DRIVER_NAME}}]}}}, "ml")
    claim = api.get("resourceclaims", "c", "ml")
    claim["status"] = {"allocation": {
        "devices": {"results": [{"request": "model", "driver": DRIVER_NAME, "pool": node, "device": "f-m1"}]},
        "nodeSelector": {"nodeSelectorTerms": [{"matchFields": [
            {"key": "metadata.name", "operator": "In", "values": [node]}]}]}}}
    return api.update("resourceclaims", "c", claim, namespace="ml", subresource="status")


def _status_patch(api: FakeApiServer, user: User, body: dict[str, Any]) -> kubernetes.client.ApiException | None:
    objects = kubernetes.client.CustomObjectsApi(api.api_client(api.token_for(user)))
    try:
        objects.patch_namespaced_custom_object_status(GROUP, V, "ml", "resourceclaims", "c", body)
    except kubernetes.client.ApiException as exc:
        return exc
    return None


DEVICES = {"status": {"devices": [{"driver": DRIVER_NAME, "pool": "node-1", "device": "f-m1", "conditions": [
    {"type": "weightcache.io/model-ready", "status": "True", "reason": "Fetched", "message": "",
     "lastTransitionTime": "2026-01-01T00:00:00Z"}]}]}}


def test_rbac_refuses_a_verb_no_bound_role_grants() -> None:
    with FakeApiServer(rbac=shipped_rbac()) as api:
        core = kubernetes.client.CoreV1Api(api.api_client(api.token_for(daemon_user("node-1"))))
        with pytest.raises(kubernetes.client.ApiException) as refused:
            core.delete_node("node-1")
        assert refused.value.status == 403
        assert json.loads(refused.value.body)["message"] == (
            'nodes "node-1" is forbidden: User "system:serviceaccount:weightcache:weightcache-daemon" cannot delete '
            'resource "nodes" in API group "" at the cluster scope')
        with pytest.raises(kubernetes.client.ApiException) as unknown:
            kubernetes.client.CoreV1Api(api.api_client("no-such-token")).list_node()
        assert unknown.value.status == 401


def test_status_devices_need_the_driver_subresource_for_the_callers_node() -> None:
    with FakeApiServer(rbac=shipped_rbac().without("resourceclaims/driver")) as api:
        _claim(api, "node-1")
        refused = _status_patch(api, daemon_user("node-1"), DEVICES)
        assert refused is not None and refused.status == 422
        assert json.loads(refused.body)["message"] == (
            'ResourceClaim.resource.k8s.io "c" is invalid: status.devices: Forbidden: changing status.devices requires '
            'resource="resourceclaims/driver", verb="[associated-node:patch arbitrary-node:patch]" permission: '
            'resourceclaims.resource.k8s.io "models.weightcache.io" is forbidden: User '
            '"system:serviceaccount:weightcache:weightcache-daemon" cannot associated-node:patch resource '
            '"resourceclaims/driver" in API group "resource.k8s.io" in the namespace "ml"')
    with FakeApiServer(rbac=shipped_rbac()) as api:
        _claim(api, "node-1")
        other = _status_patch(api, daemon_user("node-2"), DEVICES)  # a token of another node: arbitrary-node only
        assert other is not None and other.status == 422
        assert 'verb="[arbitrary-node:patch]"' in json.loads(other.body)["message"]
        assert _status_patch(api, daemon_user("node-1"), DEVICES) is None
        assert api.get("resourceclaims", "c", "ml")["status"]["devices"][0]["device"] == "f-m1"


def test_status_allocation_needs_the_binding_subresource() -> None:
    with FakeApiServer(rbac=shipped_rbac()) as api:
        _claim(api, "node-1")
        refused = _status_patch(api, daemon_user("node-1"), {"status": {"allocation": None}})
        assert refused is not None and refused.status == 422
        assert 'requires resource="resourceclaims/binding", verb="patch"' in json.loads(refused.body)["message"]


def test_device_status_goes_with_the_allocation() -> None:
    with FakeApiServer() as api:
        claim = _claim(api, "node-1")
        claim["status"]["devices"] = DEVICES["status"]["devices"]
        claim = api.update("resourceclaims", "c", claim, namespace="ml", subresource="status")
        claim["status"].pop("allocation")
        assert "devices" not in api.update("resourceclaims", "c", claim, namespace="ml", subresource="status")["status"]


@pytest.mark.parametrize(("sent", "stored"), [
    ("5000000", "5M"), ("10000000000", "10G"), ("1500", "1500"), ("8", "8"), ("0.5", "500m"), ("1024Ki", "1Mi"),
    ("1536Ki", "1536Ki"), ("1.5Gi", "1536Mi"), ("512", "512"), ("1000m", "1"), ("1e3", "1e3")])
def test_quantities_are_stored_canonical(sent: str, stored: str) -> None:
    assert canonical_quantity(sent) == stored
    with FakeApiServer() as api:
        api.create("resourceslices", {"metadata": {"name": "s"}, "spec": {
            "driver": DRIVER_NAME, "nodeName": "n", "pool": {"name": "n", "generation": 1, "resourceSliceCount": 1},
            "sharedCounters": [{"name": "cache", "counters": {"bytes": {"value": sent}}}]}})
        assert api.get("resourceslices", "s")["spec"]["sharedCounters"][0]["counters"]["bytes"]["value"] == stored


def test_the_publishers_quantities_are_already_canonical() -> None:
    for n in (0, 1, 8, 999, 1000, 1500, 5_000_000, 10**10, 16060522496, 2**63 - 1, 10**18, 7 * 10**18):
        assert quantity(n) == canonical_quantity(str(n)), n


def test_a_claim_templates_spec_is_immutable() -> None:
    with FakeApiServer() as api:
        spec = {"spec": {"devices": {"requests": [{"name": "model", "exactly": {"deviceClassName": DRIVER_NAME}}]}}}
        api.create("resourceclaimtemplates", {"metadata": {"name": "t"}, "spec": spec}, "ml")
        changed = api.get("resourceclaimtemplates", "t", "ml")
        changed["spec"]["spec"]["devices"]["requests"][0]["name"] = "other"
        with pytest.raises(kubernetes.client.ApiException) as refused:
            kubernetes.client.CustomObjectsApi(api.api_client()).replace_namespaced_custom_object(
                GROUP, V, "ml", "resourceclaimtemplates", "t", changed)
        assert refused.value.status == 422 and "spec: Invalid value" in refused.value.body
        assert "field is immutable" in refused.value.body


def test_a_pods_extended_resource_claim_status_names_its_containers_and_claim() -> None:
    with FakeApiServer() as api:
        api.create("pods", {"metadata": {"name": "p"}, "spec": {"containers": [
            {"name": "vllm", "image": "x", "resources": {"requests": {"models.weightcache.io/m1": "1"}}}]}}, "ml")
        pod = api.get("pods", "p", "ml")
        pod["status"] = {"extendedResourceClaimStatus": {"resourceClaimName": "p-extended-resources-abcde",
                         "requestMappings": [{"containerName": "nope", "resourceName": "models.weightcache.io/m1",
                                              "requestName": "container-0-request-0"}]}}
        with pytest.raises(Exception, match="containerName: Invalid value"):
            api.update("pods", "p", pod, namespace="ml", subresource="status")
        pod["status"]["extendedResourceClaimStatus"]["requestMappings"][0]["containerName"] = "vllm"
        api.update("pods", "p", pod, namespace="ml", subresource="status")
        plain = api.get("pods", "p", "ml")
        plain["status"] = {}
        api.update("pods", "p", plain, namespace="ml")  # the main resource keeps the status the scheduler wrote
        assert api.get("pods", "p", "ml")["status"]["extendedResourceClaimStatus"]["resourceClaimName"]


# Node taints and JSON patch (the startup taint, docs/startup-taint.md) ---------------------------------------------
TAINT = {"key": "weightcache.io/models-pending", "effect": "NoSchedule"}


def _node_patch(api: FakeApiServer, body: list[dict[str, Any]], token: str | None = None) -> None:
    core = kubernetes.client.CoreV1Api(api.api_client(token))
    core.patch_node("node-1", body, _content_type="application/json-patch+json")


def test_a_json_patch_whose_test_fails_is_invalid_and_changes_nothing() -> None:
    with FakeApiServer() as api:
        api.create("nodes", {"metadata": {"name": "node-1"}, "spec": {"taints": [TAINT]}})
        with pytest.raises(kubernetes.client.ApiException) as refused:
            _node_patch(api, [{"op": "test", "path": "/spec/taints", "value": []},
                              {"op": "replace", "path": "/spec/taints", "value": []}])
        assert refused.value.status == 422 and json.loads(refused.value.body)["reason"] == "Invalid"
        assert api.get("nodes", "node-1")["spec"]["taints"] == [TAINT]


def test_node_taints_are_validated_and_an_empty_list_is_dropped() -> None:
    with FakeApiServer() as api:
        api.create("nodes", {"metadata": {"name": "node-1"}, "spec": {"taints": [TAINT]}})
        for bad in ([TAINT, TAINT], [{**TAINT, "effect": "Sometimes"}]):
            with pytest.raises(kubernetes.client.ApiException) as refused:
                _node_patch(api, [{"op": "replace", "path": "/spec/taints", "value": bad}])
            assert refused.value.status == 422
        _node_patch(api, [{"op": "replace", "path": "/spec/taints", "value": []}])
        assert "taints" not in api.get("nodes", "node-1")["spec"]


def test_the_node_policy_refuses_the_daemon_another_nodes_taint() -> None:
    with FakeApiServer(rbac=shipped_rbac(), policies=shipped_policies()) as api:
        api.create("nodes", {"metadata": {"name": "node-1"}, "spec": {"taints": [TAINT]}})
        remove = [{"op": "replace", "path": "/spec/taints", "value": []}]
        with pytest.raises(kubernetes.client.ApiException) as refused:
            _node_patch(api, remove, api.token_for(daemon_user("node-2")))
        assert refused.value.status == 403
        assert json.loads(refused.value.body)["message"].startswith(
            "ValidatingAdmissionPolicy 'weightcache-daemon-own-node' with binding 'weightcache-daemon-own-node' "
            "denied request: weightcache-daemon may only write its own node (node-2), not node-1")
        _node_patch(api, remove, api.token_for(daemon_user("node-1")))
        assert "taints" not in api.get("nodes", "node-1")["spec"]
