"""CRD and RBAC manifests: official schemas (kubernetes-validate, strict), the CRD's own OpenAPI schema on
sample ModelCaches, and least privilege checked against the requests the daemon really makes."""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.fake_apiserver import FakeApiServer, crd_schemas, model_cache, node
from tests.fixtures_crd_cel import cel_errors
from weightcache.kube.report import ModelState, NodeReporter
from weightcache.kube.watch import ModelCacheWatcher
from weightcache.peers.discovery import discover as discover_peers

DEPLOY = Path(__file__).resolve().parent.parent / "deploy" / "daemonset"
FILES = ["crd-modelcache.yaml", "crd-modelcachenode.yaml", "rbac.yaml"]
VERSIONS = ["1.30", kubernetes_validate.utils.latest_version()]


def docs(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((DEPLOY / name).read_text()) if d]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", FILES)
def test_manifests_match_the_official_strict_schemas(name, version):
    for doc in docs(name):
        kubernetes_validate.validate(doc, version, strict=True)


def test_official_validation_catches_a_typo():
    crd = copy.deepcopy(docs("crd-modelcache.yaml")[0])
    crd["spec"]["versions"][0]["subresource"] = crd["spec"]["versions"][0].pop("subresources")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(crd, VERSIONS[-1], strict=True)


def _walk(schema: dict[str, Any], path: str = "") -> list[str]:
    """Nodes of a structural schema that lack a type (the API server refuses such CRDs): only an int-or-string
    node has none (apiextensions' structural schema rules: "type ... must be empty" with x-kubernetes-int-or-string)."""
    typed = ("type" in schema) != bool(schema.get("x-kubernetes-int-or-string"))
    bad = [] if typed or schema.get("x-kubernetes-preserve-unknown-fields") else [path or "<root>"]
    for key, sub in (schema.get("properties") or {}).items():
        bad += _walk(sub, f"{path}.{key}")
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            bad += _walk(schema[key], f"{path}[{key}]")
    return bad


def test_crds_are_structural_cluster_scoped_with_status_and_printer_columns():
    crds = (("crd-modelcache.yaml", "ModelCache", "mc"), ("crd-modelcachenode.yaml", "ModelCacheNode", "mcn"))
    for name, kind, short in crds:
        (crd,) = docs(name)
        spec = crd["spec"]
        assert crd["metadata"]["name"] == f"{spec['names']['plural']}.weightcache.io"
        assert spec["group"] == "weightcache.io" and spec["scope"] == "Cluster" and spec["names"]["kind"] == kind
        assert short in spec["names"]["shortNames"]
        (version,) = spec["versions"]
        assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
        assert version["subresources"] == {"status": {}}
        assert any(c["name"] == "Age" and c["type"] == "date" for c in version["additionalPrinterColumns"])
        assert _walk(version["schema"]["openAPIV3Schema"]) == []
    version = docs("crd-modelcache.yaml")[0]["spec"]["versions"][0]
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns["Source"] == ".spec.source" and columns["Tier"] == ".spec.tier"


GOOD = model_cache("llama", "s3://models/llama-3-8b/", node_selector={"gpu": "h100"}, tier="memory", revision="v1",
                   include=["*.safetensors", "*.json"], exclude=["original/*"], allowedNamespaces=["team-a", "*"],
                   priority=10)


def _spec_errors(obj: dict[str, Any]) -> list[str]:
    schema = crd_schemas()["modelcaches"]
    body = {k: v for k, v in obj.items() if k != "metadata"}
    return [e.message for e in jsonschema.Draft202012Validator(schema).iter_errors(body)] + [
        m for _, m in cel_errors(schema, body)]  # the CRD's CEL rules (spec.source) as the API server runs them


def test_sample_model_cache_matches_the_crd_schema():
    assert _spec_errors(GOOD) == []
    for source in ("gs://b/p/", "az://container/p/", "https://host:8443/models/x/", "file:///srv/models/x/"):
        assert _spec_errors(model_cache("x", source)) == [], source


@pytest.mark.parametrize("field, value", [
    ("source", "ftp://models/x/"),
    ("source", "https://user:pw@host/x/"),
    ("source", "s3://"),
    ("tier", "ssd"),
    ("priority", "high"),
    ("priority", 5000),
    ("nodeSelector", {"gpu": 1}),
    ("allowedNamespaces", ["Team_A"]),
    ("include", ["/abs/*"]),
    ("revision", "bad revision"),
])
def test_bad_model_caches_are_refused_by_the_crd_schema(field, value):
    bad = copy.deepcopy(GOOD)
    bad["spec"][field] = value
    assert _spec_errors(bad), f"{field}={value!r} passed"


def test_source_is_required():
    bad = copy.deepcopy(GOOD)
    del bad["spec"]["source"]
    assert _spec_errors(bad)


# least privilege --------------------------------------------------------------------------------------------------
_VERB = {"POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def _needed(requests: list[Any]) -> set[tuple[str, str, str, str]]:
    """(apiGroup, resource[/sub], verb, namespace) for each request, as RBAC's authorizer sees it."""
    needed = set()
    for r in requests:
        m = re.match(r"^/apis?/(?:(?P<group>[^/]+)/)?v[^/]+(?:/namespaces/(?P<ns>[^/]+))?/(?P<res>[^/]+)"
                     r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$", r.path)
        assert m, r.path
        group = "" if r.path.startswith("/api/") else m["group"]
        resource = m["res"] + (f"/{m['sub']}" if m["sub"] else "")
        verb = _VERB.get(r.method) or ("get" if m["name"] else "watch" if r.query.get("watch") else "list")
        needed.add((group, resource, verb, m["ns"] or ""))
    return needed


def _allows(rules: list[dict[str, Any]], need: tuple[str, str, str, str]) -> bool:
    group, resource, verb, _ = need
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def _roles(subject: str) -> list[tuple[str, list[dict[str, Any]]]]:
    """(namespace or "" for cluster-wide, rules) of every role bound to the service account `subject`."""
    all_docs = docs("rbac.yaml")
    roles = {(d["kind"], d["metadata"].get("namespace", ""), d["metadata"]["name"]): d["rules"]
             for d in all_docs if d["kind"] in ("ClusterRole", "Role")}
    found = []
    for b in all_docs:
        if b["kind"] in ("ClusterRoleBinding", "RoleBinding") and any(s["name"] == subject for s in b["subjects"]):
            ns = b["metadata"].get("namespace", "")
            kind = b["roleRef"]["kind"]
            found.append((ns, roles[(kind, ns if kind == "Role" else "", b["roleRef"]["name"])]))
    return found


def _permitted(subject: str, need: tuple[str, str, str, str]) -> bool:
    return any((not ns or ns == need[3]) and _allows(rules, need) for ns, rules in _roles(subject))


def test_the_daemons_requests_are_exactly_covered_by_its_rbac(apiserver: FakeApiServer):
    apiserver.create("nodes", node("n1"))
    mc = apiserver.create("modelcaches", model_cache("llama", "s3://models/llama/"))
    watcher = ModelCacheWatcher(apiserver.api_client())
    watcher.start()
    assert watcher.wait_synced(10)
    apiserver.wait_requests("GET", "modelcaches", watch="True")
    watcher.stop()
    reporter = NodeReporter(apiserver.api_client(), "n1", min_interval=0)
    reporter.node_labels()  # what the daemon's reconcile reads, then patches (daemon/reconcile._label_changes)
    reporter.set_labels({"weightcache.io/m00000000000000000000": "ready"})
    reporter.report("llama", ModelState("Fetching"))
    reporter.forget("llama")
    reporter.event(mc, "FetchFailed", "x")
    reporter.event(mc, "FetchFailed", "x")
    reporter.pod_event("team-a", "llama-0", "uid-0", "WeightsLoaded", "x")  # the pods' stages (csi/telemetry.py)
    assert discover_peers(apiserver.api_client(), "n1") == []  # peers read each other's ModelCacheNode status
    needed = _needed(apiserver.requests)  # setup wrote directly, not over HTTP
    refused = [n for n in needed if not _permitted("weightcache-daemon", n)]
    assert not refused, refused
    assert ("", "events", "create", "default") in needed and ("", "events", "create", "team-a") in needed
    # Events in any namespace (pods live in any): node-policy.yaml confines them to the daemon's own node
    # (tests/test_pod_telemetry.py::test_the_events_policy_confines_a_daemon_token_to_its_own_node)
    dangerous = {"delete", "deletecollection", "escalate", "bind", "impersonate", "update"}
    for _ns, rules in _roles("weightcache-daemon"):
        for rule in rules:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert not dangerous & set(rule["verbs"]) or \
                rule["resources"] == ["modelcachenodes/status"]
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert any(n[1] == resource and n[2] == verb for n in needed) or verb == "get", (resource, verb)


def test_webhook_may_only_read_model_caches():
    (only,) = _roles("weightcache-webhook")
    read = {"apiGroups": ["weightcache.io"], "resources": ["modelcaches"], "verbs": ["get", "list", "watch"]}
    assert only == ("", [read])


def test_cli_role_is_unbound_and_cannot_touch_node_status():
    assert _roles("weightcache-cli") == []
    (cli,) = [d for d in docs("rbac.yaml") if d["metadata"]["name"] == "weightcache-cli"]
    assert not _allows(cli["rules"], ("weightcache.io", "modelcachenodes/status", "patch", ""))
    assert not _allows(cli["rules"], ("", "nodes", "patch", ""))


def _doc_yaml() -> list[dict[str, Any]]:
    text = (DEPLOY.parent.parent / "docs" / "modelcache.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", text, re.DOTALL)
    return [d for block in blocks for d in yaml.safe_load_all(block) if d]


def test_examples_in_the_docs_are_valid():
    examples = _doc_yaml()
    kinds = [d["kind"] for d in examples]
    assert kinds == ["ModelCache"]  # the node policy is shipped (deploy/daemonset/node-policy.yaml), not pasted
    assert _spec_errors(examples[0]) == []
    for doc in examples[1:]:
        kubernetes_validate.validate(doc, VERSIONS[-1], strict=True)
