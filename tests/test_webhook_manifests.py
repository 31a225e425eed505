"""The webhook's manifests: valid against the official (strict) schemas, and consistent with each other, with the
CLI they run and with the cert-manager overlay."""

from __future__ import annotations

import argparse
import base64
import os
import ssl
from pathlib import Path
from typing import Any

import celpy
import pytest
from celpy.adapter import json_to_cel
from cryptography import x509

from tests.fixtures_k8s_schema import (
    SchemaError,
    has_schema,
    load_docs,
    validate_file,
    validate_manifest,
    validate_strict,
)
from weightcache.webhook.certs import service_dns_names, write_service_certs
from weightcache.webhook.command import add_commands

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
WEBHOOK = DEPLOY / "daemonset" / "webhook.yaml"
CERT_MANAGER = DEPLOY / "cert-manager" / "component"  # the certificates, a component any entry point takes


def by_kind(docs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in docs}


@pytest.fixture(scope="module")
def objs() -> dict[str, dict[str, Any]]:
    return by_kind(load_docs(WEBHOOK))


@pytest.mark.parametrize("version", ["1.30", "1.33"])
def test_every_document_matches_the_strict_schema(version: str) -> None:
    docs = load_docs(WEBHOOK)
    assert {d["kind"] for d in docs} == {"Deployment", "PodDisruptionBudget", "Service", "MutatingWebhookConfiguration"}
    for doc in docs:
        assert has_schema(doc, version)
        validate_strict(doc, version)
    assert validate_file(CERT_MANAGER / "webhook-ca-injection.yaml", version=version) == []
    custom = validate_file(CERT_MANAGER / "certificate.yaml", version=version)
    assert {d["kind"] for d in custom} == {"Issuer", "Certificate"}, "cert-manager kinds have no core schema"


def test_strict_schema_catches_a_typo_the_api_server_would_drop(objs: dict[str, dict[str, Any]]) -> None:
    deployment = objs["Deployment"]
    typo = {**deployment, "spec": {**deployment["spec"], "replica": 2}}
    validate_manifest(typo)  # lenient: unknown fields pass, as the API server would silently drop them
    with pytest.raises(SchemaError, match="'replica' was unexpected"):
        validate_strict(typo)


def test_deployment_is_highly_available_and_locked_down(objs: dict[str, dict[str, Any]]) -> None:
    deployment, pdb, service = objs["Deployment"], objs["PodDisruptionBudget"], objs["Service"]
    spec = deployment["spec"]
    pod_labels = spec["template"]["metadata"]["labels"]
    assert spec["replicas"] == 2 and pdb["spec"]["minAvailable"] == 1
    for selector in (
        spec["selector"]["matchLabels"],
        pdb["spec"]["selector"]["matchLabels"],
        service["spec"]["selector"],
    ):
        assert selector.items() <= pod_labels.items()
    pod = spec["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
    (c,) = pod["containers"]
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    port_names = {p["name"] for p in c["ports"]}
    assert service["spec"]["ports"][0]["targetPort"] in port_names
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz" and c["readinessProbe"]["httpGet"]["scheme"] == "HTTPS"
    assert deployment["metadata"]["namespace"] == pdb["metadata"]["namespace"] == service["metadata"]["namespace"]


def test_deployment_args_are_a_valid_command_line(objs: dict[str, dict[str, Any]]) -> None:
    parser = argparse.ArgumentParser(prog="weightcache")
    add_commands(parser.add_subparsers())
    pod = objs["Deployment"]["spec"]["template"]["spec"]
    args = parser.parse_args(pod["containers"][0]["args"])
    assert args.func.__name__ == "run_webhook"
    mount = pod["containers"][0]["volumeMounts"][0]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert args.cert.parent == args.key.parent == Path(mount["mountPath"])
    assert args.port == pod["containers"][0]["ports"][0]["containerPort"]
    certificate = [
        d for d in load_docs(CERT_MANAGER / "certificate.yaml") if d["metadata"]["name"] == "weightcache-webhook"
    ]
    assert volume["secret"]["secretName"] == certificate[0]["spec"]["secretName"]


def test_webhook_configuration_follows_the_admission_rules(objs: dict[str, dict[str, Any]]) -> None:
    (hook,) = objs["MutatingWebhookConfiguration"]["webhooks"]
    service = objs["Service"]
    assert hook["admissionReviewVersions"] == ["v1"] and hook["sideEffects"] == "None"
    assert hook["reinvocationPolicy"] == "IfNeeded" and hook["failurePolicy"] in ("Fail", "Ignore")
    assert 1 <= hook["timeoutSeconds"] <= 30
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": [""],
            "apiVersions": ["v1"],
            "resources": ["pods"],
            "scope": "Namespaced",
        }
    ]
    ref = hook["clientConfig"]["service"]
    assert (ref["name"], ref["namespace"], ref["path"]) == (
        service["metadata"]["name"],
        service["metadata"]["namespace"],
        "/mutate",
    )
    assert ref["port"] == service["spec"]["ports"][0]["port"]
    # the webhook's own namespace (by its label, so a renamed namespace stays excluded) and kube-system are never
    # sent pods; any other namespace is
    (own,) = [d for d in load_docs(DEPLOY / "daemonset" / "namespace.yaml") if d["kind"] == "Namespace"]
    assert own["metadata"]["name"] == service["metadata"]["namespace"]
    selector = hook["namespaceSelector"]
    assert not selects(selector, {**own["metadata"]["labels"], "kubernetes.io/metadata.name": "renamed"})
    assert not selects(selector, {"kubernetes.io/metadata.name": "kube-system"})
    assert selects(selector, {"kubernetes.io/metadata.name": "team-a"})
    (condition,) = hook["matchConditions"]
    program = celpy.Environment().program(celpy.Environment().compile(condition["expression"]))

    def sent(metadata: dict[str, Any]) -> bool:
        return bool(program.evaluate({"object": json_to_cel({"metadata": metadata})}))
    for given in ({"weightcache.io/model": "s3://m/a/"}, {"weightcache.io/models": "a=s3://m/a/"},
                        {"weightcache.io/modle": "s3://m/a/"}):  # a typo too: the webhook warns, naming the key
        assert sent({"annotations": given}), given
    assert not sent({"annotations": {"team": "a", "example.io/weightcache.io/model": "x"}})
    assert not sent({}), "a pod without annotations is never sent"


def selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A LabelSelector's meaning (matchLabels AND every matchExpression), as the API server evaluates it."""
    ops = {
        "In": lambda k, vs: k in labels and labels[k] in vs,
        "NotIn": lambda k, vs: k not in labels or labels[k] not in vs,
        "Exists": lambda k, vs: k in labels,
        "DoesNotExist": lambda k, vs: k not in labels,
    }
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items()) and all(
        ops[e["operator"]](e["key"], e.get("values", [])) for e in selector.get("matchExpressions", []))


def test_cert_manager_overlay_fits_the_base(objs: dict[str, dict[str, Any]]) -> None:
    kustomization = load_docs(CERT_MANAGER / "kustomization.yaml")[0]
    assert kustomization["kind"] == "Component"
    entry = load_docs(CERT_MANAGER.parent / "kustomization.yaml")[0]
    assert entry["resources"] == ["../daemonset"] and entry["components"] == ["component"]
    for resource in kustomization["resources"]:
        assert (CERT_MANAGER / resource).exists(), resource
    patch = load_docs(CERT_MANAGER / kustomization["patches"][0]["path"])[0]
    assert patch["metadata"]["name"] == objs["MutatingWebhookConfiguration"]["metadata"]["name"]
    namespace, name = patch["metadata"]["annotations"]["cert-manager.io/inject-ca-from"].split("/")
    docs = load_docs(CERT_MANAGER / "certificate.yaml")
    certificates = {(d["metadata"]["namespace"], d["metadata"]["name"]): d for d in docs if d["kind"] == "Certificate"}
    issuers = {d["metadata"]["name"] for d in docs if d["kind"] == "Issuer"}
    serving = certificates[(namespace, name)]
    service = objs["Service"]["metadata"]
    assert set(serving["spec"]["dnsNames"]) <= set(service_dns_names(service["name"], service["namespace"]))
    assert f"{service['name']}.{service['namespace']}.svc" in serving["spec"]["dnsNames"]
    for cert in certificates.values():
        assert cert["spec"]["issuerRef"]["name"] in issuers and not has_schema(cert)


def test_certs_are_a_working_ca_and_serving_pair(tmp_path: Path) -> None:
    bundle = write_service_certs(tmp_path, service="weightcache-webhook", namespace="weightcache")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ca.crt", "tls.crt", "tls.key"], "the CA key is not kept"
    assert os.stat(tmp_path / "tls.key").st_mode & 0o777 == 0o600
    leaf = x509.load_pem_x509_certificate((tmp_path / "tls.crt").read_bytes())
    names = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "weightcache-webhook.weightcache.svc" in names.get_values_for_type(x509.DNSName)
    server = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    server.load_cert_chain(tmp_path / "tls.crt", tmp_path / "tls.key")  # key matches cert
    assert base64.b64decode(bundle) == (tmp_path / "ca.crt").read_bytes()
    ca = x509.load_pem_x509_certificate((tmp_path / "ca.crt").read_bytes())
    leaf.verify_directly_issued_by(ca)


def test_certs_command_explains_an_unwritable_directory(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    parser = argparse.ArgumentParser(prog="weightcache")
    add_commands(parser.add_subparsers())
    args = parser.parse_args(
        ["webhook", "certs", "--service", "s", "--namespace", "n", "--out", str(tmp_path / "file")]
    )
    assert args.func(args) == 1
