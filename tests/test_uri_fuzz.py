"""Property tests of the reference parser: any text either parses into a canonical, safe reference or is refused
with InvalidReferenceError (never another exception), and parsing is idempotent."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.dra.fetchable import PREFIX, key_of
from weightcache.errors import InvalidReferenceError
from weightcache.uri import (
    SCHEMES,
    ModelRef,
    canonical_uri,
    is_model_key,
    is_readiness_label,
    model_key,
    parse_ref,
    readiness_label,
)
from weightcache.vocabulary import READINESS_LABEL_PREFIX

_piece = st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=12)
_segment = st.sampled_from(["models", "llama", "..", ".", "", "a@b", "x:y", "%2e%2e", "?q", "#f", "sub dir", "é"])
_reference = st.builds(
    lambda scheme, host, segs, rev: f"{scheme}://{host}/{'/'.join(segs)}{rev}",
    st.sampled_from([*SCHEMES, "S3", "ftp", "file:"]),
    st.one_of(st.sampled_from(["models", "bkt-1", "host:8080", "user:pw@host", "", "[::1]:9000", "a" * 300]),
              _piece),
    st.lists(st.one_of(_segment, _piece), max_size=6),
    st.sampled_from(["", "/", "@rev1", "/@abc123", "@", "@../x", "@" + "r" * 200]),
)


def _check(text: str) -> ModelRef | None:
    try:
        ref = parse_ref(text)
    except InvalidReferenceError:
        return None
    assert ref.scheme in SCHEMES
    parts = ref.prefix.strip("/").split("/")
    assert not {".", ".."} & set(parts), ref
    assert ref.prefix == "" or ref.prefix.endswith("/"), ref
    assert "@" not in ref.bucket, "userinfo must never survive into a reference"
    again = parse_ref(str(ref))
    assert (again.uri, again.revision) == (ref.uri, ref.revision), "canonical form must parse to itself"
    return ref


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_reference)
def test_structured_references_parse_canonically_or_are_refused(text: str) -> None:
    _check(text)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=80))
def test_any_text_parses_or_raises_invalid_reference(text: str) -> None:
    _check(text)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.text(max_size=10), max_size=3), st.lists(st.text(max_size=10), max_size=3))
def test_globs_are_checked_whatever_they_are(include: list[str], exclude: list[str]) -> None:
    try:
        ref = parse_ref("s3://models/m/", include=include, exclude=exclude)
    except InvalidReferenceError:
        return
    assert all(g and not g.startswith("/") and "\0" not in g for g in (*ref.include, *ref.exclude))


_globs = st.lists(st.sampled_from(["*.safetensors", "config.json", "*.bin", "sub/*", "a b"]), max_size=2, unique=True)


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_reference, st.text(max_size=60)), st.sampled_from([None, "v2", "abc.def"]), _globs, _globs)
def test_every_accepted_reference_round_trips_through_its_canonical_form(
        text: str, revision: str | None, include: list[str], exclude: list[str]) -> None:
    """What parses must parse again from what it prints, with and without its revision: labels, demand names and
    the policy re-read `ref.uri` (`s3://models/a@b/@v1` parsed, but its uri `s3://models/a@b/` did not, and the
    error escaped the placement controller's pass for every pod)."""
    try:
        ref = parse_ref(text, revision=revision, include=include, exclude=exclude)
    except InvalidReferenceError:
        return
    assert parse_ref(str(ref), include=ref.include, exclude=ref.exclude) == ref
    assert parse_ref(ref.uri, include=ref.include, exclude=ref.exclude) == replace(ref, revision=None)
    assert canonical_uri(str(ref)) == ref.uri
    assert is_readiness_label(ref.label_key) and ref.label_key == readiness_label(ref)


def test_a_prefix_with_at_sign_is_refused_at_parse() -> None:
    with pytest.raises(InvalidReferenceError, match="'@' may appear once, before the revision"):
        parse_ref("s3://models/a@b/@v1")
    with pytest.raises(InvalidReferenceError):
        parse_ref("s3://models/a@b/")


def test_readiness_label_names_the_selection_not_only_the_uri() -> None:
    full = parse_ref("s3://models/llama/")
    config = parse_ref("s3://models/llama/", include=["config.json"])
    assert full.label_key != config.label_key, "a node holding only config.json is not ready for the whole model"
    assert readiness_label("s3://models/llama/") == full.label_key
    assert parse_ref("s3://models/llama/@v2").label_key == full.label_key, "the revision is not part of it"


def test_is_readiness_label_matches_only_the_labels_readiness_label_makes() -> None:
    assert is_readiness_label(readiness_label("s3://models/llama/"))
    for key in ("weightcache.io/memory-pool", "weightcache.io/m", "weightcache.io/mabc",
                readiness_label("s3://models/llama/") + "0", readiness_label("s3://models/llama/") + "\n",
                "x.weightcache.io/m" + "0" * 20, "weightcache.io/M" + "0" * 20, "weightcache.io/m" + "g" * 20):
        assert not is_readiness_label(key), key


def test_the_store_the_labels_and_dra_agree_on_what_a_model_key_is() -> None:
    """One pattern (uri.MODEL_KEY_PATTERN) behind is_model_key, the readiness label and a fetchable device's name:
    the DRA name took a trailing newline (`re.match` with `$`) the other two refused."""
    key = model_key("s3://models/llama/")
    assert is_model_key(key) and is_readiness_label(READINESS_LABEL_PREFIX + key) and key_of(PREFIX + key) == key
    for bad in (key + "\n", key + "0", key[:-1], "M" + key[1:], key[:-1] + "g", " " + key, ""):
        assert not is_model_key(bad), bad
        assert not is_readiness_label(READINESS_LABEL_PREFIX + bad), bad
        assert key_of(PREFIX + bad) is None, bad


_oci_component = st.from_regex(r"\A[a-z0-9]{1,6}(?:(?:[._]|__|-{1,2})[a-z0-9]{1,4}){0,2}\Z")
_oci_revision = st.one_of(st.none(), st.from_regex(r"\A[A-Za-z0-9_][A-Za-z0-9._-]{0,20}\Z"),
                          st.from_regex(r"\A[0-9a-f]{64}\Z").map(lambda h: "sha256:" + h))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(["127.0.0.1:5000", "registry.example.com", "ghcr.io", "[::1]:5000", "localhost"]),
       st.lists(_oci_component, min_size=1, max_size=4), _oci_revision, _globs)
def test_oci_references_round_trip_through_their_canonical_form(
        registry: str, parts: list[str], revision: str | None, include: list[str]) -> None:
    """oci://REGISTRY/REPOSITORY:TAG and oci://REGISTRY/REPOSITORY@sha256:<hex> (../shared/DESIGN.md, Wave 3):
    registry as bucket, repository as prefix, tag or digest as revision; the printed form parses to the same
    reference, and so do `uri` with the revision as a flag and `uri@revision`."""
    repo = "/".join(parts)
    sep = "@" if revision and revision.startswith("sha256:") else ":"
    text = f"oci://{registry}/{repo}" + (f"{sep}{revision}" if revision else "")
    ref = parse_ref(text, include=include)
    assert (ref.scheme, ref.bucket, ref.prefix, ref.revision) == ("oci", registry, repo + "/", revision)
    assert str(ref) == text
    assert parse_ref(str(ref), include=ref.include) == ref
    assert parse_ref(ref.uri, revision=revision, include=ref.include) == ref
    if revision:
        assert parse_ref(f"{ref.uri}@{revision}", include=ref.include) == ref


@pytest.mark.parametrize("text", [
    "oci://127.0.0.1:5000/Models/tiny:v1",  # upper case repository
    "oci://127.0.0.1:5000/models/../tiny:v1",
    "oci://user:pw@127.0.0.1:5000/models/tiny:v1",
    "oci://127.0.0.1:5000/models/tiny@sha512:" + "a" * 128,
    "oci://127.0.0.1:5000/models/tiny@sha256:" + "A" * 64,
    "oci://127.0.0.1:5000/models/tiny:-v1",
    "oci://127.0.0.1:5000/models/tiny:v1?x=1",
    "oci://127.0.0.1:5000/:v1",
])
def test_bad_oci_references_are_refused(text: str) -> None:
    with pytest.raises(InvalidReferenceError):
        parse_ref(text)
