"""Denial hints that work when followed: the command a refusal names, run as written, makes the same request pass.

The hint is read from a real refusal (the webhook's AdmissionReview answer, the policy's reason the CSI plugin
returns), run in process through `weightcache.cli.main` against the fake API server (KUBECONFIG points at it),
and the same review is then answered with the ModelCaches the command wrote.
"""

from __future__ import annotations

import re
import shlex

import pytest

from tests.command import run_cli
from tests.fake_apiserver import FakeApiServer
from tests.fixtures_webhook import DRAFT, REF, admission_review, apply_response, check_pod, deployment_pod
from weightcache.policy import decide
from weightcache.webhook.mutate import review

_HINT = re.compile(r"\(or run: (weightcache prefetch [^)]*)\)")


def follow(message: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Run the command the refusal names, exactly as a user would paste it."""
    found = _HINT.search(message)
    assert found, f"the refusal names no command to run: {message}"
    argv = shlex.split(found.group(1))
    assert argv[:2] == ["weightcache", "prefetch"]
    code, _, err = run_cli(capsys, *argv[1:])
    assert code == 0, err


def answer(server: FakeApiServer, body: dict) -> dict:
    return review(body, model_caches=server.list("modelcaches"), allow_undeclared=False)["response"]


@pytest.mark.parametrize("namespace", ["inference", "team-b"])
def test_following_the_webhooks_hint_admits_the_same_pod(cluster, capsys, namespace):
    pod = deployment_pod({"weightcache.io/model": REF})
    pod["metadata"]["namespace"] = namespace
    body = admission_review(pod, namespace=namespace)
    refused = answer(cluster, body)
    assert refused["allowed"] is False and refused["status"]["code"] == 403
    assert f"--allow-namespace {namespace}" in refused["status"]["message"]

    follow(refused["status"]["message"], capsys)

    allowed = answer(cluster, body)
    assert allowed["allowed"] is True, allowed
    check_pod(apply_response(pod, {"response": allowed}))
    (mc,) = cluster.list("modelcaches")
    assert mc["spec"]["allowedNamespaces"] == [namespace]  # only the namespace that asked, not '*'
    assert answer(cluster, admission_review(pod, namespace="elsewhere"))["allowed"] is False


def test_following_the_hint_of_each_model_admits_a_pod_of_two(cluster, capsys):
    """A revision and globs in the pod's annotations: the hint declares the source, which grants every file."""
    pod = deployment_pod({"weightcache.io/models": f"llama={REF},draft={DRAFT}",
                          "weightcache.io/include": "*.safetensors,*.json"})
    body = admission_review(pod)
    for _ in range(2):  # one refusal per model, the first one undeclared first
        refused = answer(cluster, body)
        assert refused["allowed"] is False, refused
        follow(refused["status"]["message"], capsys)
    assert answer(cluster, body)["allowed"] is True
    assert len(cluster.list("modelcaches")) == 2


def test_following_the_policys_hint_at_mount_time(cluster, capsys):
    """The CSI plugin refuses a mount with the same decision (weightcache.policy.decide) and its reason."""
    decision = decide("s3://models/other/@v3", "team-c", cluster.list("modelcaches"), allow_undeclared=False)
    assert not decision.allowed
    follow(decision.reason, capsys)
    assert decide("s3://models/other/@v3", "team-c", cluster.list("modelcaches"), allow_undeclared=False).allowed
