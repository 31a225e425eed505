"""Unknown `weightcache.io/` annotation keys: a warning naming the nearest known key, or a denial with
`--unknown-annotations=deny`; known keys never warn."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.fixtures_webhook import REF, admission_review, apply_response, check_pod, deployment_pod
from weightcache.cli import build_parser
from weightcache.placement import choice
from weightcache.pods import unknown_keys
from weightcache.pods.annotations import KNOWN
from weightcache.webhook import dra_claim
from weightcache.webhook.mutate import review
from weightcache.webhook.server import Policy, _review

DOCS = Path(__file__).resolve().parents[1] / "docs" / "webhook.md"


def answer(annotations: dict[str, str], mode: unknown_keys.Mode = "warn") -> dict:
    pod = deployment_pod(annotations)
    out = review(admission_review(pod), model_caches=[], allow_undeclared=True, unknown_annotations=mode)
    response = out["response"]
    if response["allowed"]:
        check_pod(apply_response(pod, out))
    return response


def test_a_typo_of_model_warns_naming_model():
    response = answer({"weightcache.io/model": REF, "weightcache.io/modle": REF})
    assert response["allowed"] is True and "patch" in response  # the pod still gets its model
    (warning,) = response["warnings"]
    assert "weightcache.io/modle" in warning and "did you mean weightcache.io/model?" in warning
    assert len(warning) < 120


def test_the_typo_alone_warns_too():
    """Without weightcache.io/model the pod asks for nothing: allowed unchanged, but told why."""
    response = answer({"weightcache.io/modle": REF})
    assert response["allowed"] is True and "patch" not in response
    assert response["warnings"] == [unknown_keys.hint("weightcache.io/modle")]
    assert "weightcache.io/model?" in response["warnings"][0]


@pytest.mark.parametrize(("typo", "meant"), [
    ("weightcache.io/teir", "weightcache.io/tier"),
    ("weightcache.io/mountpath", "weightcache.io/mount-path"),
    ("weightcache.io/mount_path", "weightcache.io/mount-path"),
    ("weightcache.io/Placement", "weightcache.io/placement"),
    ("weightcache.io/hf_repo", "weightcache.io/hf-repo"),
    ("weightcache.io/includes", "weightcache.io/include"),
    ("weightcache.io/vai", "weightcache.io/via"),
])
def test_the_nearest_known_key_is_named(typo, meant):
    (warning,) = answer({"weightcache.io/model": REF, typo: "x"})["warnings"]
    assert warning.endswith(f"did you mean {meant}?"), warning


def test_an_unrelated_key_says_it_does_nothing_without_a_guess():
    (warning,) = answer({"weightcache.io/model": REF, "weightcache.io/owner": "team-a"})["warnings"]
    assert "did you mean" not in warning and "docs/webhook.md" in warning


def test_known_keys_get_no_warning():
    every = {"weightcache.io/model": REF, "weightcache.io/mount-path": "/weights", "weightcache.io/tier": "disk",
             "weightcache.io/containers": "server", "weightcache.io/placement": "prefer",
             "weightcache.io/include": "*.safetensors", "weightcache.io/exclude": "*.bin",
             "weightcache.io/hf-repo": "meta/llama", "weightcache.io/via": "csi",
             "example.com/weightcache.io-model": "x", "app.kubernetes.io/name": "llama"}
    response = answer(every)
    assert response["allowed"] is True and "warnings" not in response
    assert "warnings" not in answer(every, "deny") and answer(every, "deny")["allowed"] is True
    assert unknown_keys.unknown(dict.fromkeys(unknown_keys.KNOWN_KEYS, "")) == []


def test_deny_refuses_with_the_hint():
    response = answer({"weightcache.io/model": REF, "weightcache.io/modle": REF}, "deny")
    assert response["allowed"] is False and response["status"]["code"] == 400
    assert "did you mean weightcache.io/model?" in response["status"]["message"]
    assert "--unknown-annotations=deny" in response["status"]["message"]
    assert answer({"weightcache.io/modle": REF}, "deny")["allowed"] is False  # even when nothing else is asked


def test_many_unknown_keys_give_at_most_ten_short_warnings():
    keys = {f"weightcache.io/{'x' * 60}{i:02d}": "v" for i in range(30)}
    keys["weightcache.io/" + "\u202e" * 50 + "modle"] = "v"  # not shown raw: a warning is printed to terminals
    warnings = answer({"weightcache.io/model": REF, **keys})["warnings"]
    assert len(warnings) == unknown_keys.MAX_WARNINGS
    assert all(len(w) < 120 and w.isprintable() and w.isascii() for w in warnings), warnings
    assert warnings[-1].startswith("and 22 more")
    longest = "weightcache.io/" + "q" * 63
    assert len(unknown_keys.hint(longest)) < 120
    assert all(len(unknown_keys.hint(longest[:-len(k)] + k)) < 120 for k in unknown_keys.KNOWN_KEYS)


def test_the_known_keys_are_the_ones_the_webhook_reads_and_documents():
    assert dra_claim.VIA == choice.VIA == unknown_keys.VIA
    assert set(unknown_keys.KNOWN_KEYS) == {*KNOWN, dra_claim.VIA}
    documented = set(re.findall(r"^\| `(weightcache\.io/[a-z-]+)`", DOCS.read_text(), re.MULTILINE))
    documented |= set(re.findall(r"`weightcache\.io/[a-z-]+` / `(weightcache\.io/[a-z-]+)`", DOCS.read_text()))
    assert documented == set(unknown_keys.KNOWN_KEYS)


def test_the_flag_reaches_the_review():
    args = build_parser().parse_args(["webhook", "--unknown-annotations", "deny"])
    assert args.unknown_annotations == "deny"
    assert build_parser().parse_args(["webhook"]).unknown_annotations == "warn"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["webhook", "--unknown-annotations", "ignore"])
    body = admission_review(deployment_pod({"weightcache.io/model": REF, "weightcache.io/modle": REF}))
    denied = _review(body, Policy(model_caches=list, allow_undeclared=True, unknown_annotations="deny"))
    assert denied["response"]["allowed"] is False
    warned = _review(body, Policy(model_caches=list, allow_undeclared=True))
    assert warned["response"]["allowed"] is True and warned["response"]["warnings"]
