"""Cluster CLI: prefetch --cluster (create, update, wait) and status, against the fake API server."""

from __future__ import annotations

import io
import json
import re
import threading

import pytest

from tests.command import run_cli
from tests.fake_apiserver import FakeApiServer, node
from tests.fixtures_daemon import wait_until
from weightcache.dra.admission import MODEL_KEY_LABEL, model_key_label
from weightcache.errors import ClusterError
from weightcache.kube.cluster_cli import model_cache_name, prefetch_cluster, status
from weightcache.kube.report import ModelState, NodeReporter
from weightcache.uri import parse_ref

MC = "/apis/weightcache.io/v1alpha1/modelcaches"
REF = parse_ref("s3://models/Llama-3_8B/@v1", include=["*.safetensors"])


@pytest.fixture
def server(apiserver: FakeApiServer) -> FakeApiServer:
    for name in ("n1", "n2"):
        apiserver.create("nodes", node(name, {"gpu": "h100"}))
    apiserver.create("nodes", node("n3", {"gpu": "a10"}))
    return apiserver


def run(server: FakeApiServer, ref=REF, **kwargs) -> tuple[int, str]:
    out = io.StringIO()
    args = {"name": None, "node_selector": {"gpu": "h100"}, "tier": "disk", "allowed_namespaces": [], "wait": False,
            "timeout": 10.0, "out": out, "json_lines": False, "poll_interval": 0.02, **kwargs}
    return prefetch_cluster(server.api_client(), ref, **args), out.getvalue()


def play_daemon(server: FakeApiServer, phases: dict[str, list[ModelState]]) -> threading.Thread:
    """A thread that acts as the daemons of the given nodes once the ModelCache exists."""

    def daemon() -> None:
        server.wait_requests("POST", MC)  # recorded when it arrives: the object is stored after its schema checks
        name = wait_until(lambda: server.list("modelcaches"), timeout=10, what="the ModelCache stored",
                          every=0.01)[0]["metadata"]["name"]
        server.wait_requests("GET", "/api/v1/nodes")  # the CLI is waiting now
        for node_name, states in phases.items():
            reporter = NodeReporter(server.api_client(), node_name, min_interval=0)
            for state in states:
                reporter.report(name, state)

    thread = threading.Thread(target=daemon, daemon=True)
    thread.start()
    return thread


def test_name_is_a_stable_dns_label():
    name = model_cache_name(REF)
    assert re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63
    ref = parse_ref("s3://models/Llama-3_8B/", include=["*.safetensors"])
    assert name.startswith("llama-3-8b-") and name == model_cache_name(ref)
    assert model_cache_name(parse_ref("s3://models/" + "x" * 200 + "/")).__len__() <= 63


def test_prefetch_creates_the_model_cache(server):
    code, text = run(server, allowed_namespaces=["team-a"], tier="memory")
    assert code == 0 and "created" in text
    (mc,) = server.list("modelcaches")
    assert mc["metadata"]["name"] == model_cache_name(REF)
    assert mc["spec"] == {"source": "s3://models/Llama-3_8B/", "revision": "v1", "include": ["*.safetensors"],
                          "tier": "memory", "nodeSelector": {"gpu": "h100"}, "allowedNamespaces": ["team-a"]}
    # the label deploy/dra/claim-policy.yaml matches claims by: the key the model's devices publish
    assert mc["metadata"]["labels"][MODEL_KEY_LABEL] == model_key_label(REF.uri)


def test_prefetch_again_updates_with_optimistic_concurrency(server):
    run(server, allowed_namespaces=["team-a"])
    code, text = run(server, ref=parse_ref("s3://models/Llama-3_8B/", include=["*.safetensors"]),
                     node_selector={"pool": "inference"})
    assert code == 0 and "updated" in text
    (mc,) = server.list("modelcaches")
    assert mc["spec"]["nodeSelector"] == {"pool": "inference"}  # replaced, not merged
    assert "revision" not in mc["spec"]  # the new reference has none
    assert mc["spec"]["allowedNamespaces"] == ["team-a"]  # kept: not given this time
    assert mc["metadata"]["generation"] == 2
    (put,) = server.requests_matching("PUT", MC)
    assert put.body["metadata"]["resourceVersion"]


def test_invalid_spec_is_rejected_by_the_crd_schema(server):
    with pytest.raises(ClusterError, match=r"rejected it: .*tier"):
        run(server, tier="ssd")
    assert server.list("modelcaches") == []


def test_wait_follows_each_selected_node_until_ready(server):
    states = [ModelState("Fetching", bytes_done=512, bytes_total=2048),
              ModelState("Ready", bytes_done=2048, bytes_total=2048, snapshot="abcdef0123456789")]
    daemon = play_daemon(server, {"n1": states, "n2": states})
    code, text = run(server, wait=True)
    daemon.join(5)
    assert code == 0, text
    assert re.search(r"^n1\s+Ready\s+2 KiB/2 KiB 100%", text, re.MULTILINE)
    assert re.search(r"^n2\s+Ready", text, re.MULTILINE)
    assert "n3" not in text and "ready on all 2 node(s)" in text


def test_wait_stops_at_the_first_failure(server):
    daemon = play_daemon(server, {"n1": [ModelState("Ready")],
                                  "n2": [ModelState("Failed", message="bucket not found")]})
    code, text = run(server, wait=True)
    daemon.join(5)
    assert code == 1
    assert "failed on n2" in text and "bucket not found" in text


def test_wait_times_out_with_exit_2(server):
    code, text = run(server, wait=True, timeout=0.2)
    assert code == 2 and "ready on 0 of 2 node(s)" in text


def test_wait_ignores_states_of_an_older_generation(server):
    run(server)
    name = model_cache_name(REF)
    NodeReporter(server.api_client(), "n1", min_interval=0).report(name, ModelState("Ready", observed_generation=1))
    NodeReporter(server.api_client(), "n2", min_interval=0).report(name, ModelState("Ready", observed_generation=1))
    code, text = run(server, wait=True, timeout=0.2, tier="memory")  # update: generation 2, nodes not yet there
    assert code == 2 and "ready on 0 of 2" in text


def test_wait_without_matching_nodes_says_what_to_do(server):
    code, text = run(server, wait=True, node_selector={"gpu": "b200"})
    assert code == 1 and "kubectl label node NODE gpu=b200" in text


def test_json_lines_output(server):
    daemon = play_daemon(server, {"n1": [ModelState("Ready")], "n2": [ModelState("Ready")]})
    code, text = run(server, wait=True, json_lines=True)
    daemon.join(5)
    lines = [json.loads(line) for line in text.splitlines()]
    assert code == 0 and lines[0]["event"] == "created"
    assert lines[-1] == {"event": "done", "result": "ready", "nodes": 2}
    assert {ln["node"] for ln in lines if ln["event"] == "progress"} == {"n1", "n2"}


def test_status_table_and_json(server):
    run(server)
    name = model_cache_name(REF)
    fetching = ModelState("Fetching", bytes_done=1 << 30, bytes_total=4 << 30)
    NodeReporter(server.api_client(), "n1", min_interval=0).report(name, fetching)
    out = io.StringIO()
    assert status(server.api_client(), None, out=out) == 0
    lines = out.getvalue().splitlines()
    assert lines[0].split() == ["MODELCACHE", "NODE", "PHASE", "PROGRESS", "SNAPSHOT", "UPDATED", "MESSAGE"]
    assert re.search(rf"^{name}\s+n1\s+Fetching\s+1 GiB/4 GiB 25%", out.getvalue(), re.MULTILINE)
    assert re.search(rf"^{name}\s+n2\s+Pending\s+.*not reported yet", out.getvalue(), re.MULTILINE)
    out = io.StringIO()
    assert status(server.api_client(), name, out=out, output="json") == 0
    (mc,) = json.loads(out.getvalue())["modelCaches"]
    assert [n["node"] for n in mc["nodes"]] == ["n1", "n2"] and mc["nodes"][0]["bytesTotal"] == 4 << 30


def test_status_of_unknown_name(server):
    out = io.StringIO()
    assert status(server.api_client(), "nope", out=out) == 1
    assert "not found" in out.getvalue() and "weightcache status" in out.getvalue()


def test_unreachable_api_server_is_a_clear_cluster_error(server):
    client = server.api_client()
    server.stop()
    with pytest.raises(ClusterError, match="cannot reach the Kubernetes API server"):
        prefetch_cluster(client, REF, name=None, node_selector={}, tier="disk", allowed_namespaces=[], wait=False,
                         timeout=1, out=io.StringIO(), json_lines=False)


def test_api_errors_are_translated_without_raw_responses(server):
    server.fail_requests = 1
    with pytest.raises(ClusterError) as info:
        run(server)
    assert info.value.status == 500 and "creating ModelCache" in str(info.value)
    assert "HTTP response headers" not in str(info.value)


# weightcache.io/size-bytes: `prefetch --cluster` lists the source with the CLI's credentials ------------------------
def _cli(server: FakeApiServer, tmp_path, monkeypatch, argv: list[str], capsys) -> tuple[int, str]:

    server.use_as_kubeconfig(tmp_path, monkeypatch)
    code, _, err = run_cli(capsys, "prefetch", *argv, "--cluster", "--node-selector", "gpu=h100",
                           "--allow-namespace", "ml")
    return code, err


def test_prefetch_cluster_writes_the_selected_size_and_a_node_offers_it(server, s3, tmp_path, monkeypatch, capsys):
    from weightcache.dra.fetchable import declared
    from weightcache.vocabulary import SIZE_BYTES_ANNOTATION

    s3.put("models", "llama/model-00001.safetensors", b"a" * 1000)
    s3.put("models", "llama/model-00002.safetensors", b"b" * 234)
    s3.put("models", "llama/original/consolidated.pth", b"c" * 5000)  # not selected: not counted
    argv = ["s3://models/llama/", "--include", "*.safetensors", "--endpoint-url", s3.endpoint_url]
    code, err = _cli(server, tmp_path, monkeypatch, argv, capsys)
    assert code == 0, err
    (mc,) = server.list("modelcaches")
    assert mc["metadata"]["annotations"] == {SIZE_BYTES_ANNOTATION: "1234"}
    (offer,) = declared([mc]).values()  # what a 1.36 node reads: offered as f-<key>, consuming 1234 bytes
    assert offer.size == 1234 and offer.ref.include == ("*.safetensors",)

    # Again, same selection, but the CLI cannot list it now (a bucket it may not read): the size stays.
    server.patch("modelcaches", mc["metadata"]["name"], {"metadata": {"annotations": {"team": "ml"}}},
                 "application/merge-patch+json")
    code, err = _cli(server, tmp_path, monkeypatch,
                     ["s3://models/llama/", "--include", "*.safetensors", "--endpoint-url", "http://127.0.0.1:9"],
                     capsys)
    assert code == 0 and "no weightcache.io/size-bytes" in err, err
    (mc,) = server.list("modelcaches")
    assert mc["metadata"]["annotations"] == {SIZE_BYTES_ANNOTATION: "1234", "team": "ml"}  # others untouched

    # Another selection of the same ModelCache (--name) that cannot be listed: the old size is dropped, since it
    # would let a node offer a model that does not fit.
    code, err = _cli(server, tmp_path, monkeypatch, ["s3://models/llama/", "--name", mc["metadata"]["name"],
                                                     "--endpoint-url", "http://127.0.0.1:9"], capsys)
    assert code == 0, err
    (mc,) = server.list("modelcaches")
    assert mc["metadata"]["annotations"] == {"team": "ml"} and declared([mc]) == {}


def test_model_cache_body_without_a_size_has_no_annotation():
    from weightcache.kube.cluster_cli import model_cache_body

    body = model_cache_body(REF, name="x", node_selector={}, tier="disk", allowed_namespaces=[])
    assert "annotations" not in body["metadata"]
    body = model_cache_body(REF, name="x", node_selector={}, tier="disk", allowed_namespaces=[], size_bytes=7)
    assert body["metadata"]["annotations"] == {"weightcache.io/size-bytes": "7"}
