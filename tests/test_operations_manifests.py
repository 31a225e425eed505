"""Operations manifests: the alert rules parse and name only metrics the code exports, the NetworkPolicies are
strictly valid and select the real pods and ports, DRA combines with cert-manager, and the ModelCache source rule
(CEL, evaluated with cel-python) refuses a credential without quoting it."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from celpy.adapter import json_to_cel
from prometheus_client import CollectorRegistry

from tests.fixtures_crd_cel import cel_eval
from tests.test_manifests_kustomize import DEPLOY, assert_valid, kustomize, one, overlay
from weightcache.daemon.metrics import SAMPLED, Metrics
from weightcache.webhook.server import Metrics as WebhookMetrics

RULES = DEPLOY / "components" / "prometheus" / "rules.yaml"


def exported_series() -> set[str]:
    """Every series name the daemon and the webhook expose, from their real registries."""
    names: set[str] = set()
    for registry in (Metrics().registry, _webhook_registry()):
        for family in registry.collect():
            kind = family.type
            names.add(family.name + ("_total" if kind == "counter" else ""))
            if kind == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    names.update(n + "_total" if kind == "counter" else n for n, (kind, _, _) in SAMPLED.items())
    return names


def _webhook_registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    WebhookMetrics.create(registry)
    return registry


def _selectors(expr: Any, out: set[str]) -> set[str]:
    if type(expr).__name__ == "VectorSelector":
        out.add(expr.name)
    for attr in ("lhs", "rhs", "expr", "args", "vector_selector"):
        child = getattr(expr, attr, None)
        for c in child if isinstance(child, list) else [child] if child is not None else []:
            _selectors(c, out)
    return out


def test_alert_rules_parse_and_use_only_exported_metrics() -> None:
    doc = yaml.safe_load(RULES.read_text())
    rules = [r for g in doc["spec"]["groups"] for r in g["rules"]]
    known = exported_series()
    operations = (Path(__file__).parent.parent / "docs" / "operations.md").read_text().lower()
    used: set[str] = set()
    for rule in rules:
        names = _selectors(promql_parser.parse(rule["expr"]), set())
        assert names, rule["alert"]
        assert names <= known, (rule["alert"], names - known)
        used |= names
        anchor = rule["annotations"]["runbook_url"].split("#", 1)[1]
        assert f"### {anchor}" in operations, f"docs/operations.md has no runbook section for {rule['alert']}"
        assert anchor == rule["alert"].lower()
    themes = {"weightcache_fetch_failures_total", "weightcache_peer_errors_total", "weightcache_csi_errors_total",
              "weightcache_webhook_review_seconds_bucket", "weightcache_store_used_bytes"}
    assert themes <= used
    with pytest.raises(ValueError):  # the parser is a real one: a typo does not pass
        promql_parser.parse("sum by (node (rate(x[5m]))")


def test_prometheus_and_network_policy_components_render_strictly_valid(tmp_path: Path) -> None:
    objs = kustomize(overlay(tmp_path / "o", resources=["cert-manager"], components=["prometheus", "network-policy",
                                                                                        "peers"]))
    assert_valid(objs)
    assert one(objs, "PrometheusRule")["metadata"]["namespace"] == "weightcache"
    daemon, webhook = one(objs, "DaemonSet"), one(objs, "Deployment", "weightcache-webhook")
    for policy, workload in ((one(objs, "NetworkPolicy", "weightcache-node"), daemon),
                             (one(objs, "NetworkPolicy", "weightcache-webhook"), webhook)):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
        ports = {p.get("name"): p["containerPort"] for c in workload["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for rule in policy["spec"]["ingress"]:
            for port in rule["ports"]:
                assert port["port"] in ports or port["port"] in ports.values(), (policy["metadata"]["name"], port)
    peers_rule = next(r for r in one(objs, "NetworkPolicy", "weightcache-node")["spec"]["ingress"] if "from" in r)
    assert peers_rule["ports"] == [{"port": 9479, "protocol": "TCP"}]
    node_labels = daemon["spec"]["template"]["metadata"]["labels"]
    assert peers_rule["from"][0]["podSelector"]["matchLabels"].items() <= node_labels.items()


def test_dra_combines_with_cert_manager(tmp_path: Path) -> None:
    """Two entry points as resources bring deploy/daemonset twice (kustomize: duplicate Namespace); the
    cert-manager component on deploy/dra is the way, as deploy/cert-manager/component/kustomization.yaml says."""
    mine = tmp_path / "o"
    mine.mkdir()
    spec = {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [os.path.relpath(DEPLOY / "dra", mine)],
            "components": [os.path.relpath(DEPLOY / "cert-manager" / "component", mine)]}
    (mine / "kustomization.yaml").write_text(yaml.safe_dump(spec))
    objs = kustomize(mine)
    assert "--dra" in one(objs, "DaemonSet")["spec"]["template"]["spec"]["containers"][0]["args"]
    assert one(objs, "Certificate", "weightcache-webhook")
    hook = one(objs, "MutatingWebhookConfiguration")
    assert hook["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == "weightcache/weightcache-webhook"
    assert len([o for o in objs if o["kind"] == "Namespace"]) == 1
    assert_valid([o for o in objs if not o["apiVersion"].startswith("resource.k8s.io")])


def _source_rule() -> dict[str, str]:
    crd = yaml.safe_load((DEPLOY / "daemonset" / "crd-modelcache.yaml").read_text())
    (version,) = crd["spec"]["versions"]
    source = version["schema"]["openAPIV3Schema"]["properties"]["spec"]["properties"]["source"]
    assert "pattern" not in source, "a pattern error quotes the value back"
    (rule,) = source["x-kubernetes-validations"]
    return dict(rule)


@pytest.mark.parametrize(("source", "allowed"), [
    ("s3://models/llama-3-8b/", True), ("hf://org/name", True), ("https://example.com/m/", True),
    ("file:///srv/models/m/", True), ("gs://bucket", True),
    ("s3://AKIAIOSFODNN7EXAMPLE:wJalrXUtnFEMIbPxRfiCYEXAMPLEKEY@bucket/", False),
    ("https://alice:hunter2@example.com/m/", False), ("s3:/models", False), ("ftp://x/y", False),
    ("s3://models/a b/", False),
])
def test_source_rule_refuses_credentials_with_a_fixed_message(source: str, allowed: bool) -> None:
    rule = _source_rule()
    assert bool(cel_eval(rule["rule"], {"self": json_to_cel(source)})) is allowed
    for secret in ("wJalrXUtnFEMIbPxRfiCYEXAMPLEKEY", "hunter2", "AKIA", "%s", "{"):
        assert secret not in rule["message"]
