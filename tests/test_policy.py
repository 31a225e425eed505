"""Policy covers what a grant says (weightcache/policy.py): globs, file:// sources, symlinks out of a source."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from weightcache.errors import HostileKeyError, InvalidReferenceError
from weightcache.policy import confine_file, covers, decide
from weightcache.sources import open_source
from weightcache.uri import parse_globs, parse_ref


def mc(name: str, source: str, namespaces: list[str], **spec: Any) -> dict[str, Any]:
    return {"metadata": {"name": name}, "spec": {"source": source, "allowedNamespaces": namespaces, **spec}}


SAFETENSORS_ONLY = [mc("llama-weights", "s3://models/llama/", ["team-a"], include=["*.safetensors"])]


def test_a_glob_grant_does_not_give_the_whole_prefix() -> None:
    whole = decide("s3://models/llama/", "team-a", SAFETENSORS_ONLY, allow_undeclared=True)
    assert not whole.allowed
    assert "include ['*.safetensors']" in whole.reason and "include: '*.safetensors'" in whole.reason
    other = decide(parse_ref("s3://models/llama/", include=["*.bin"]), "team-a", SAFETENSORS_ONLY,
                   allow_undeclared=True)
    assert not other.allowed


def test_a_request_within_the_grant_is_allowed() -> None:
    same = parse_ref("s3://models/llama/@r1", include=["*.safetensors"])
    narrower = parse_ref("s3://models/llama/", include=["*.safetensors"], exclude=["*-00002-*"])
    for ref in (same, narrower):
        assert decide(ref, "team-a", SAFETENSORS_ONLY, allow_undeclared=False).allowed


def test_grant_excludes_must_be_kept_by_the_request() -> None:
    caches = [mc("no-bin", "s3://models/llama/", ["*"], exclude=["*.bin"])]
    assert not decide("s3://models/llama/", "x", caches, allow_undeclared=False).allowed
    assert decide(parse_ref("s3://models/llama/", exclude=["*.bin"]), "x", caches, allow_undeclared=False).allowed
    assert decide(parse_ref("s3://models/llama/", include=["*.json"], exclude=["*.bin", "*.pt"]), "x", caches,
                  allow_undeclared=False).allowed


def test_any_covering_grant_wins_and_other_namespaces_still_need_theirs() -> None:
    caches = [*SAFETENSORS_ONLY, mc("llama-all", "s3://models/llama/", ["team-b"])]
    assert decide("s3://models/llama/", "team-b", caches, allow_undeclared=False).allowed
    assert not decide("s3://models/llama/", "team-a", caches, allow_undeclared=False).allowed
    denied = decide("s3://models/llama/", "team-c", caches, allow_undeclared=True)
    assert not denied.allowed and "spec.allowedNamespaces" in denied.reason


def test_covers_compares_globs_as_written() -> None:
    grant = parse_ref("s3://mmm/x/", include=["*.safetensors", "*.json"], exclude=["*.bin"])
    assert covers(grant, parse_ref("s3://mmm/x/", include=["*.json"], exclude=["*.bin"]))
    assert not covers(grant, parse_ref("s3://mmm/x/", include=["model-*.safetensors"], exclude=["*.bin"]))
    assert not covers(grant, parse_ref("s3://mmm/x/", exclude=["*.bin"]))
    assert covers(parse_ref("s3://mmm/x/"), parse_ref("s3://mmm/x/", include=["a"]))


def test_exact_files_are_covered_by_what_the_grant_selects() -> None:
    grant = parse_ref("s3://mmm/x/", include=["*.safetensors", "*.json"], exclude=["tokenizer*"])
    assert covers(grant, parse_ref("s3://mmm/x/", include=["model-1.safetensors", "config.json"]))
    assert not covers(grant, parse_ref("s3://mmm/x/", include=["model-1.safetensors", "tokenizer.json"]))
    assert not covers(grant, parse_ref("s3://mmm/x/", include=["model-1.safetensors", "weights.bin"]))
    assert decide(parse_ref("s3://models/llama/", include=["a.safetensors"]), "team-a", SAFETENSORS_ONLY,
                  allow_undeclared=False).allowed


def test_malformed_grants_grant_nothing() -> None:
    caches = [mc("bad", "s3://models/llama/", ["team-a"], include="*.safetensors"),
              {"metadata": {"name": "worse"}, "spec": ["not", "a", "mapping"]}]
    assert not decide("s3://models/llama/", "team-a", caches, allow_undeclared=False).allowed


def test_file_models_are_never_undeclared(tmp_path: Path) -> None:
    uri = f"file://{tmp_path}/"
    denied = decide(uri, "team-a", [], allow_undeclared=True)
    assert not denied.allowed
    assert "allowUndeclaredModels does not apply" in denied.reason and f"spec.source: {uri}" in denied.reason
    assert decide(uri, "team-a", [mc("local", uri, ["team-a"])], allow_undeclared=False).allowed


@pytest.mark.parametrize("path", ["/proc/self/", "/sys/kernel/", "/dev/", "/", "/var/lib/kubelet/pods/x/",
                                  "/var/lib/kubelet/", "/var/lib/weightcache/blobs/", "/var/"])
def test_file_models_never_overlap_system_kubelet_or_store_directories(path: str) -> None:
    uri = f"file://{path}"
    forbidden = ("/var/lib/kubelet", "/var/lib/weightcache")
    decision = decide(uri, "ns", [mc("declared", uri, ["ns"])], allow_undeclared=True, forbidden_paths=forbidden)
    assert not decision.allowed
    assert "never models" in decision.reason


def test_a_symlinked_model_directory_into_the_kubelet_dir_is_refused(tmp_path: Path) -> None:
    kubelet = tmp_path / "kubelet"
    (kubelet / "pki").mkdir(parents=True)
    (tmp_path / "innocent").symlink_to(kubelet / "pki")
    uri = f"file://{tmp_path}/innocent/"
    decision = decide(uri, "ns", [mc("d", uri, ["ns"])], allow_undeclared=True, forbidden_paths=(kubelet,))
    assert not decision.allowed and f"resolves to {kubelet / 'pki'}" in decision.reason


def test_symlinks_resolve_only_inside_the_declared_source(tmp_path: Path) -> None:
    secret = tmp_path / "kubelet-pki.key"
    secret.write_text("PRIVATE KEY")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    (model / "weights.bin").symlink_to(secret)
    with pytest.raises(HostileKeyError, match=r"weights\.bin.*leads outside the model's directory"):
        open_source(parse_ref(f"file://{model}/")).list()
    (model / "weights.bin").unlink()
    (model / "inner.bin").write_text("x")
    (model / "alias.bin").symlink_to("inner.bin")  # inside the tree: fine
    assert sorted(o.relpath for o in open_source(parse_ref(f"file://{model}/")).list()) == \
        ["alias.bin", "config.json", "inner.bin"]


def test_a_hugging_face_snapshot_may_link_into_its_repo_blobs_only(tmp_path: Path) -> None:
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    (repo / "blobs" / "abc").write_text("w")
    snap = repo / "snapshots" / "rev"
    snap.mkdir(parents=True)
    (snap / "model.safetensors").symlink_to("../../blobs/abc")
    confine_file(str(snap / "model.safetensors"), f"{snap}/", "model.safetensors")
    (tmp_path / "outside").write_text("x")
    (snap / "evil").symlink_to(tmp_path / "outside")
    with pytest.raises(HostileKeyError):
        confine_file(str(snap / "evil"), f"{snap}/", "evil")


@pytest.mark.parametrize(("text", "globs"), [
    ("", ()), ("*.safetensors", ("*.safetensors",)), (" *.json , *.safetensors ,", ("*.json", "*.safetensors")),
    ('["a,b*.bin", "*.json"]', ("a,b*.bin", "*.json")),
])
def test_glob_attributes_are_comma_separated_or_json(text: str, globs: tuple[str, ...]) -> None:
    assert parse_globs(text, "include") == globs


@pytest.mark.parametrize("text", ['["a", 1]', "[not json", "/etc/*", '["/abs"]'])
def test_bad_glob_attributes_say_what_to_write(text: str) -> None:
    with pytest.raises(InvalidReferenceError, match="include"):
        parse_globs(text, "include")


def test_the_webhook_carries_annotation_globs_into_the_volume_and_checks_them() -> None:
    from tests.fixtures_webhook import admission_review, apply_response, deployment_pod
    from weightcache.webhook.mutate import review

    caches = [mc("llama-weights", "s3://models/llama/", ["inference"], include=["*.safetensors", "*.json"])]
    narrow = deployment_pod({"weightcache.io/model": "s3://models/llama/",
                             "weightcache.io/include": "*.safetensors, *.json"})
    answer = review(admission_review(narrow), model_caches=caches, allow_undeclared=False)
    assert answer["response"]["allowed"], answer
    pod = apply_response(narrow, dict(answer))
    (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "wc-model"]
    assert volume["csi"]["volumeAttributes"]["include"] == '["*.safetensors", "*.json"]'
    assert parse_globs(volume["csi"]["volumeAttributes"]["include"], "include") == ("*.safetensors", "*.json")

    whole = deployment_pod({"weightcache.io/model": "s3://models/llama/"})
    denied = review(admission_review(whole), model_caches=caches, allow_undeclared=False)["response"]
    assert not denied["allowed"] and denied["status"]["code"] == 403
    assert "weightcache.io/include" in denied["status"]["message"]
    bad = deployment_pod({"weightcache.io/model": "s3://models/llama/", "weightcache.io/include": '["/etc/*"]'})
    refused = review(admission_review(bad), model_caches=caches, allow_undeclared=False)["response"]
    assert not refused["allowed"] and "weightcache.io/include" in refused["status"]["message"]
