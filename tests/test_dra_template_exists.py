"""`via: dra` refuses a pod whose ResourceClaimTemplate does not exist in its namespace, naming the command that
creates it; the lookup is a real watcher of ResourceClaimTemplates against the fake API server."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.fake_apiserver import FakeApiServer
from tests.fixtures_daemon import wait_until
from tests.fixtures_webhook import REF, admission_review, deployment_pod
from weightcache.dra.template import claim_template
from weightcache.kube.watch import ModelCacheWatcher
from weightcache.webhook import dra_templates
from weightcache.webhook.mutate import review

NS = "ml"


@pytest.fixture
def templates(apiserver: FakeApiServer) -> Iterator[tuple[FakeApiServer, ModelCacheWatcher]]:
    watcher = dra_templates.watch(apiserver.api_client())
    assert watcher.wait_synced(10)
    dra_templates.install(dra_templates.from_watcher(watcher))
    try:
        yield apiserver, watcher
    finally:
        dra_templates.install(None)
        watcher.stop()


def answer(namespace: str = NS) -> dict[str, object]:
    pod = deployment_pod({"weightcache.io/model": REF, "weightcache.io/via": "dra"})
    body = admission_review(pod)
    body["request"]["namespace"] = namespace
    return dict(review(body, model_caches=[], allow_undeclared=True)["response"])


def test_a_missing_template_is_refused_with_the_command_that_creates_it(
        templates: tuple[FakeApiServer, ModelCacheWatcher]) -> None:
    api, _watcher = templates
    refused = answer()
    assert refused["allowed"] is False
    message = refused["status"]["message"]  # type: ignore[index]
    assert "does not exist" in message and f"python -m weightcache.dra.template {REF}" in message
    cmd = message.split("`")[1].split(" | ")[0].split()[1:]
    printed = subprocess.run([sys.executable, *cmd], check=True, capture_output=True, text=True).stdout
    template = yaml.safe_load(printed)
    assert template["metadata"]["namespace"] == NS
    api.create("resourceclaimtemplates", template, NS)  # what `kubectl apply -f -` does
    wait_until(lambda: answer()["allowed"], timeout=10, what="the template to be seen", every=0.02)
    assert answer("other")["allowed"] is False, "a template in another namespace does not count"


def test_unknown_is_never_a_refusal() -> None:
    dra_templates.install(None)
    assert answer()["allowed"] is True
    assert dra_templates.from_watcher(type("W", (), {"wait_synced": lambda self, t: False})())(NS, "x") is None
    assert claim_template(REF, namespace=NS)["kind"] == "ResourceClaimTemplate"


def test_the_webhook_command_with_dra_watches_templates(apiserver: FakeApiServer, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`weightcache webhook --dra` (what deploy/dra sets) installs the lookup; without --dra nothing is refused."""
    from weightcache.webhook.command import _policy

    apiserver.use_as_kubeconfig(tmp_path, monkeypatch)
    _, stop = _policy(None)
    try:
        assert answer()["allowed"] is True, "without --dra templates are not looked up"
    finally:
        stop()
    _, stop = _policy(None, dra=True)
    try:
        wait_until(lambda: answer()["allowed"] is False, timeout=10, what="the lookup to refuse", every=0.02)
    finally:
        stop()
        dra_templates.install(None)
