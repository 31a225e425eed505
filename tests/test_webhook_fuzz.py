"""Property-based fuzzing: whatever the annotations and the pod, the answer is an allow with a patch the API
server accepts (and that re-invocation leaves alone), or a denial with a message, or a 400 for a body that is no
Pod CREATE review; never a crash."""

from __future__ import annotations

import asyncio
import copy
import http.client
import json
import ssl
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.fixtures_webhook import admission_review, apply_response, check_pod, container, deployment_pod
from weightcache.errors import BadAdmissionReviewError
from weightcache.webhook.certs import make_ca, make_serving_cert
from weightcache.webhook.mutate import review
from weightcache.webhook.server import Policy, make_app, start

FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

good_refs = st.sampled_from(
    [
        "s3://models/llama-3-8b/",
        "s3://models/llama-3-8b",
        "s3://models/llama/@v1",
        "gs://bucket-a/x/y/",
        "https://host:8080/models/m/",
        "memory://mem/x/",
    ]
)
bad_refs = st.one_of(
    st.sampled_from(
        [
            "s3://Bad_Bucket/x",
            "s3://user:pw@host/x",
            "models/llama",
            "s3://models/@",
            "s3://models/a/../b",
            "",
        ]
    ),
    st.text(max_size=30),
)
refs = st.one_of(good_refs, good_refs, good_refs, bad_refs)
names = st.one_of(
    st.from_regex(r"[a-z0-9]([a-z0-9-]{0,8}[a-z0-9])?", fullmatch=True),
    st.sampled_from(["Llama", "a_b", "-x", "x" * 61, "", "model"]),
)
models_value = st.one_of(
    st.lists(st.tuples(names, refs), min_size=1, max_size=4).map(lambda es: ",".join(f"{n}={r}" for n, r in es)),
    st.text(max_size=40),
)
options = {
    "weightcache.io/mount-path": st.sampled_from(
        ["/models", "/w/", "/opt/m-1", "/m", "models", "/a/../b", "/", "/x y"]
    ),
    "weightcache.io/containers": st.one_of(
        st.lists(st.sampled_from(["server", "proxy", "warmup"]), min_size=1, max_size=3, unique=True).map(",".join),
        st.sampled_from(["ghost", "server,server", "", "Server"]),
        st.text(max_size=20),
    ),
    "weightcache.io/tier": st.sampled_from(["disk", "memory", "disk", "ssd", "", "Disk"]),
    "weightcache.io/require-cached": st.sampled_from(["true", "false", "true", "TRUE", "yes", ""]),
    "other.io/annotation": st.text(max_size=10),
}
annotations = st.one_of(
    st.fixed_dictionaries({"weightcache.io/model": refs}, optional=options),
    st.fixed_dictionaries({"weightcache.io/models": models_value}, optional=options),
    st.fixed_dictionaries(
        {}, optional={"weightcache.io/model": refs, "weightcache.io/models": models_value, **options}
    ),
)
expression = st.fixed_dictionaries(
    {
        "key": st.sampled_from(["gpu", "zone", "weightcache.io/m0123456789abcdef0123"]),
        "operator": st.sampled_from(["In", "Exists"]),
    }
).map(lambda e: {**e, "values": ["ready"]} if e["operator"] == "In" else e)
term = st.one_of(
    st.builds(lambda es: {"matchExpressions": es}, st.lists(expression, min_size=1, max_size=2)), st.just({})
)
affinity = st.one_of(
    st.none(),
    st.just({}),
    st.builds(
        lambda req, pref: {
            "nodeAffinity": {
                **(
                    {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": req}}
                    if req is not None
                    else {}
                ),
                **(
                    {
                        "preferredDuringSchedulingIgnoredDuringExecution": [
                            {"weight": 1, "preference": {"matchExpressions": [e]}} for e in pref
                        ]
                    }
                    if pref is not None
                    else {}
                ),
            }
        },
        st.one_of(st.none(), st.lists(term, max_size=3)),
        st.one_of(st.none(), st.lists(expression, max_size=2)),
    ),
)
extra_mounts = st.lists(
    st.sampled_from(
        [
            {"name": "scratch", "mountPath": "/scratch"},
            {"name": "scratch", "mountPath": "/models/model"},
            {"name": "wc-model", "mountPath": "/models/model", "readOnly": True},
        ]
    ),
    max_size=2,
    unique_by=lambda m: m["mountPath"],
)
extra_env = st.lists(
    st.sampled_from(
        [
            {"name": "HF_HOME", "value": "/tmp"},
            {"name": "WEIGHTCACHE_MODEL_PATH", "value": "/models/model"},
            {"name": "WEIGHTCACHE_MODEL_PATH", "value": "/elsewhere"},
        ]
    ),
    max_size=2,
    unique_by=lambda e: e["name"],
)


@st.composite
def pods(draw: st.DrawFn) -> dict[str, Any]:
    def one(name: str) -> dict[str, Any]:
        c = container(name)
        c["volumeMounts"] += draw(extra_mounts)
        env = draw(extra_env)
        if env:
            c["env"] = env
        return c

    app = [one(n) for n in draw(st.lists(st.sampled_from(["server", "proxy"]), min_size=1, max_size=2, unique=True))]
    init = [one(n) for n in draw(st.lists(st.just("warmup"), max_size=1))]
    extra_volumes = [{"name": "scratch", "emptyDir": {}}]
    if draw(st.booleans()):
        extra_volumes.append(
            draw(
                st.sampled_from(
                    [
                        {"name": "wc-model", "emptyDir": {}},
                        {
                            "name": "wc-model",
                            "csi": {
                                "driver": "csi.weightcache.io",
                                "readOnly": True,
                                "volumeAttributes": {
                                    "model": "s3://models/llama-3-8b/",
                                    "revision": "",
                                    "tier": "disk",
                                },
                            },
                        },
                    ]
                )
            )
        )
    pod = deployment_pod(
        draw(annotations),
        containers=app,
        init_containers=init or None,
        affinity=draw(affinity),
        extra_volumes=extra_volumes,
    )
    return pod


@FUZZ
@given(pod=pods(), undeclared=st.booleans())
def test_any_annotated_pod_gets_a_valid_patch_or_a_clear_denial(pod: dict[str, Any], undeclared: bool) -> None:
    policy = {
        "model_caches": [
            {"metadata": {"name": "all"}, "spec": {"source": "s3://models/llama-3-8b/", "allowedNamespaces": ["*"]}}
        ],
        "allow_undeclared": undeclared,
    }
    if not _valid_before(pod):
        return
    answer = review(admission_review(pod), **policy)
    response = answer["response"]
    if not response["allowed"]:
        assert "patch" not in response
        assert response["status"]["code"] in (400, 403, 409) and len(response["status"]["message"]) > 20
        return
    patched = apply_response(pod, answer)
    check_pod(patched)
    again = review(admission_review(patched), **policy)["response"]
    assert again["allowed"] and "patch" not in again, "re-invocation must add nothing"


def _valid_before(pod: dict[str, Any]) -> bool:
    """Only pods the API server itself would accept are interesting (the webhook is not asked about others)."""
    try:
        check_pod(pod)
    except AssertionError:
        return False
    return True


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=12,
)


@FUZZ
@given(
    spec=st.dictionaries(st.sampled_from(["containers", "volumes", "initContainers", "affinity"]), json_values),
    annotations=st.one_of(json_values, st.just({"weightcache.io/model": "s3://models/x/"})),
    envelope=st.dictionaries(st.sampled_from(["uid", "kind", "operation", "object"]), json_values, max_size=2),
)
def test_malformed_reviews_are_bad_requests_never_crashes(spec: Any, annotations: Any, envelope: Any) -> None:
    body = admission_review({"metadata": {"annotations": annotations}, "spec": spec})
    body["request"].update(envelope)
    try:
        answer = review(copy.deepcopy(body), model_caches=[], allow_undeclared=True)
    except BadAdmissionReviewError as exc:
        assert str(exc)
        return
    if "patch" in answer["response"]:
        apply_response(body["request"]["object"], answer)  # must apply cleanly to what was sent


valid_annotations = st.one_of(
    st.fixed_dictionaries({"weightcache.io/model": good_refs}),
    st.lists(
        st.tuples(st.from_regex(r"[a-z]([a-z0-9-]{0,6}[a-z0-9])?", fullmatch=True), good_refs),
        min_size=1,
        max_size=3,
        unique_by=lambda e: e[0],
    ).map(lambda es: {"weightcache.io/models": ",".join(f"{n}={r}" for n, r in es)}),
).flatmap(
    lambda a: st.fixed_dictionaries(
        {k: st.just(v) for k, v in a.items()},
        optional={
            "weightcache.io/mount-path": st.sampled_from(["/models", "/w/", "/opt/m-1"]),
            "weightcache.io/tier": st.sampled_from(["disk", "memory"]),
            "weightcache.io/require-cached": st.sampled_from(["true", "false"]),
        },
    )
)


@FUZZ
@given(pod=pods(), wanted=valid_annotations)
def test_valid_annotations_always_patch_unless_the_pod_holds_an_injected_name(
    pod: dict[str, Any], wanted: dict[str, str]
) -> None:
    pod["metadata"]["annotations"] = wanted
    if not _valid_before(pod):
        return
    answer = review(admission_review(pod), model_caches=[], allow_undeclared=True)
    response = answer["response"]
    if not response["allowed"]:
        assert response["status"]["code"] == 409, response["status"]
        return
    patched = apply_response(pod, answer)
    check_pod(patched)
    names = (
        ["model"]
        if "weightcache.io/model" in wanted
        else [e.split("=")[0] for e in wanted["weightcache.io/models"].split(",")]
    )
    volumes = {v["name"]: v for v in patched["spec"]["volumes"]}
    for name in names:
        assert volumes[f"wc-{name}"]["csi"]["readOnly"] is True
        for c in patched["spec"]["containers"]:
            assert any(m["name"] == f"wc-{name}" and m["readOnly"] is True for m in c["volumeMounts"])


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[http.client.HTTPSConnection]:
    """The real server on its own loop thread, and one kept-alive HTTPS connection to it (as kube-apiserver keeps)."""
    folder: Path = tmp_path_factory.mktemp("tls")
    ca = make_ca()
    pair = make_serving_cert(ca, ["localhost"])
    (folder / "tls.crt").write_bytes(pair.cert_pem)
    (folder / "tls.key").write_bytes(pair.key_pem)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, name="webhook-under-fuzz", daemon=True)
    thread.start()
    app = make_app(Policy(model_caches=list, allow_undeclared=True))
    running = asyncio.run_coroutine_threadsafe(
        start(app, cert=folder / "tls.crt", key=folder / "tls.key", host="127.0.0.1", port=0), loop
    ).result(30)
    context = ssl.create_default_context(cadata=ca.cert_pem.decode())
    conn = http.client.HTTPSConnection("localhost", running.port, context=context, timeout=30)
    try:
        yield conn
    finally:
        conn.close()
        asyncio.run_coroutine_threadsafe(running.stop(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
        loop.close()


bodies = st.one_of(
    pods().map(lambda p: (p, json.dumps(admission_review(p)).encode())),
    json_values.map(lambda v: (None, json.dumps(v).encode())),
    st.binary(max_size=64).map(lambda b: (None, b)),
)


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(case=bodies)
def test_over_https_never_a_500_never_a_bad_patch(live: http.client.HTTPSConnection, case: tuple[Any, bytes]) -> None:
    pod, body = case
    live.request("POST", "/mutate?timeout=10s", body=body, headers={"Content-Type": "application/json"})
    resp = live.getresponse()
    answer = json.loads(resp.read())
    assert resp.status in (200, 400), (resp.status, answer)
    if resp.status == 400:
        assert answer["error"] == "bad_request" and answer["message"]
        return
    assert pod is not None and answer["response"]["uid"] == json.loads(body)["request"]["uid"]
    if answer["response"]["allowed"] and _valid_before(pod):
        check_pod(apply_response(pod, answer))
