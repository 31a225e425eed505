"""Every YAML document under deploy/ against the official Kubernetes JSON schemas (kubernetes-validate, strict:
unknown fields fail), plus the checks a schema cannot make: selectors match template labels, names agree across
objects, the CSIDriver is the driver our plugin reports, and each kustomization lists every file beside it."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from weightcache.csi.identity import DRIVER_NAME

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
VERSIONS = ("1.30.0", kubernetes_validate.latest_version())  # oldest Kubernetes we support, newest schemas
EXTERNAL_KINDS = {("cert-manager.io/v1", "Issuer"), ("cert-manager.io/v1", "Certificate"),
                  ("monitoring.coreos.com/v1", "PodMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}
KUSTOMIZE_KINDS = ("Kustomization", "Component")
# Kinds newer than VERSIONS[0], validated from the version that introduced them (deploy/dra needs 1.34)
INTRODUCED = {("resource.k8s.io/v1", "DeviceClass"): (1, 34)}
WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")


def patch_files() -> set[Path]:
    """Files kustomizations use as patches: partial objects, checked once rendered (test_manifests_kustomize.py)."""
    found = set()
    for k in DEPLOY.rglob("kustomization.yaml"):
        for patch in yaml.safe_load(k.read_text()).get("patches", []):
            if "path" in patch:
                found.add((k.parent / patch["path"]).resolve())
    return found


def documents() -> list[tuple[str, int, dict[str, Any]]]:
    found = []
    patches = patch_files()
    for path in sorted(DEPLOY.rglob("*.y*ml")):
        # deploy/helm: a chart's templates are not YAML until rendered (tests/test_helm_chart.py renders them)
        if path.resolve() in patches or (DEPLOY / "helm") in path.parents:
            continue
        for i, doc in enumerate(yaml.safe_load_all(path.read_text())):
            if doc:
                found.append((str(path.relative_to(DEPLOY)), i, doc))
    return found


DOCS = documents()
OBJECTS = [d for _, _, d in DOCS if d.get("kind") not in KUSTOMIZE_KINDS]


def find(kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [d for d in OBJECTS if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def daemonset() -> dict[str, Any]:
    (ds,) = find("DaemonSet", "weightcache-node")
    return ds


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    return next(c for c in pod_spec["containers"] if c["name"] == name)


def test_deploy_has_the_node_plugin_manifests() -> None:
    names = {p for p, _, _ in DOCS}
    assert {"daemonset/csidriver.yaml", "daemonset/daemonset.yaml", "daemonset/namespace.yaml",
            "daemonset/kustomization.yaml"} <= names


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("path", "index", "doc"), [d for d in DOCS if d[2].get("kind") not in KUSTOMIZE_KINDS],
                         ids=[f"{p}#{i}:{d.get('kind')}" for p, i, d in DOCS if d.get("kind") not in KUSTOMIZE_KINDS])
def test_document_matches_official_schema(path: str, index: int, doc: dict[str, Any], version: str) -> None:
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in EXTERNAL_KINDS:
        assert doc["metadata"]["name"] and isinstance(doc.get("spec"), dict)
        return
    since = INTRODUCED.get(key)
    if since is not None and tuple(int(x) for x in version.split(".")[:2]) < since:
        pytest.skip(f"{key[1]} {key[0]} exists from Kubernetes {since[0]}.{since[1]} on")
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        pytest.fail(f"{path} document {index} ({key[1]} {doc['metadata'].get('name')}): {exc.message} at "
                    f"{'.'.join(map(str, exc.path))}")


def test_strict_validation_rejects_a_typo() -> None:
    broken = copy.deepcopy(daemonset())
    broken["spec"]["template"]["spec"]["containers"][0]["volumeMounts"][0]["readonly"] = True  # not readOnly
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, VERSIONS[0], strict=True)


@pytest.mark.parametrize("kustomization", sorted(DEPLOY.rglob("kustomization.yaml")), ids=str)
def test_kustomization_lists_every_file_and_only_existing_ones(kustomization: Path) -> None:
    spec = yaml.safe_load(kustomization.read_text())
    listed = list(spec.get("resources", [])) + list(spec.get("components", []))
    listed += [p["path"] for p in spec.get("patches", []) if "path" in p]
    listed += list(spec.get("patchesStrategicMerge", []))
    for entry in listed:
        target = kustomization.parent / entry
        assert target.is_file() or (target / "kustomization.yaml").is_file(), f"{kustomization}: {entry} is missing"
    beside = {p.name for p in kustomization.parent.glob("*.y*ml")} - {kustomization.name}
    unlisted = beside - set(listed)
    assert not unlisted, f"{kustomization} does not list {sorted(unlisted)}: add them under resources"


def test_workload_selectors_match_their_template_labels() -> None:
    workloads = [d for d in OBJECTS if d["kind"] in WORKLOADS]
    assert workloads
    for w in workloads:
        selector = w["spec"]["selector"]["matchLabels"]
        labels = w["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), f"{w['kind']} {w['metadata']['name']}: selector {selector}"
    for svc in find("Service"):
        selector = svc["spec"].get("selector", {})
        assert any(selector.items() <= w["spec"]["template"]["metadata"]["labels"].items() for w in workloads), (
            f"Service {svc['metadata']['name']} selects no pods: {selector}")


def test_namespaced_objects_use_declared_namespaces_and_accounts() -> None:
    namespaces = {d["metadata"]["name"] for d in find("Namespace")} | {"default"}
    for d in OBJECTS:
        ns = d["metadata"].get("namespace")
        assert ns is None or ns in namespaces, f"{d['kind']} {d['metadata']['name']}: namespace {ns} not created"
    accounts = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in find("ServiceAccount")}
    configmaps = {(d["metadata"]["namespace"], d["metadata"]["name"]) for d in find("ConfigMap")}
    for w in (d for d in OBJECTS if d["kind"] in WORKLOADS):
        ns, pod = w["metadata"]["namespace"], w["spec"]["template"]["spec"]
        assert (ns, pod["serviceAccountName"]) in accounts
        for volume in pod.get("volumes", []):
            if "configMap" in volume:
                assert (ns, volume["configMap"]["name"]) in configmaps


def test_csidriver_is_the_driver_the_plugin_reports() -> None:
    (driver,) = find("CSIDriver")
    assert driver["metadata"]["name"] == DRIVER_NAME
    spec = driver["spec"]
    assert spec["attachRequired"] is False and spec["podInfoOnMount"] is True
    assert spec["volumeLifecycleModes"] == ["Ephemeral"]


def test_daemonset_wires_plugin_sidecars_and_kubelet_together() -> None:
    pod = daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    plugin = container(pod, "weightcache")
    registrar = container(pod, "node-driver-registrar")
    probe = container(pod, "liveness-probe")

    def mount_of(c: dict[str, Any], volume: str) -> dict[str, Any]:
        return next(m for m in c["volumeMounts"] if m["name"] == volume)

    for c in pod["containers"]:
        for m in c["volumeMounts"]:
            assert m["name"] in volumes, f"{c['name']} mounts undeclared volume {m['name']}"
    # one socket: the plugin serves it, both sidecars dial it, kubelet finds it through the registrar
    args = plugin["args"]
    endpoint = args[args.index("--csi-endpoint") + 1]
    socket_in_pod = endpoint.removeprefix("unix://")
    socket_dir = mount_of(plugin, "socket-dir")["mountPath"]
    assert Path(socket_in_pod).parent == Path(socket_dir)
    for sidecar in (registrar, probe):
        assert f"--csi-address={socket_in_pod}" in sidecar["args"]
        assert mount_of(sidecar, "socket-dir")["mountPath"] == socket_dir
    host_socket_dir = volumes["socket-dir"]["hostPath"]["path"]
    assert host_socket_dir == f"/var/lib/kubelet/plugins/{DRIVER_NAME}"
    assert f"--kubelet-registration-path={host_socket_dir}/{Path(socket_in_pod).name}" in registrar["args"]
    assert mount_of(registrar, "registration-dir")["mountPath"] == "/registration"
    assert volumes["registration-dir"]["hostPath"]["path"] == "/var/lib/kubelet/plugins_registry"
    # our bind mounts must reach kubelet and the pods: Bidirectional, which the API server allows only privileged
    kubelet = mount_of(plugin, "kubelet-dir")
    assert kubelet["mountPropagation"] == "Bidirectional"
    assert kubelet["mountPath"] == volumes["kubelet-dir"]["hostPath"]["path"] == "/var/lib/kubelet"
    for c in pod["containers"]:
        if any(m.get("mountPropagation") == "Bidirectional" for m in c["volumeMounts"]):
            assert c.get("securityContext", {}).get("privileged") is True, c["name"]
    assert "IPC_LOCK" in plugin["securityContext"]["capabilities"]["add"]
    # the store survives the pod: a hostPath, at the --root the daemon is given
    root = args[args.index("--root") + 1]
    assert mount_of(plugin, "store")["mountPath"] == root and "hostPath" in volumes["store"]
    node_name = next(e for e in plugin["env"] if e["name"] == "NODE_NAME")
    assert node_name["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # liveness: the plugin's probe port is the one the livenessprobe sidecar serves
    port = plugin["livenessProbe"]["httpGet"]["port"]
    container_port = next(p["containerPort"] for p in plugin["ports"] if p["name"] == port)
    assert f"--http-endpoint=:{container_port}" in probe["args"]  # --health-port is deprecated
    assert not any(a.startswith("--health-port") for a in probe["args"])
    for c in pod["containers"]:
        assert re.fullmatch(r"[^:]+:v?\d+\.\d+\.\d+", c["image"]), f"{c['name']}: pin the image tag"
