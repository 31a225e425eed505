"""Property tests of the reference parser: any text either parses into a canonical, safe reference or is refused
with InvalidReferenceError (never another exception), and parsing is idempotent."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.errors import InvalidReferenceError
from weightcache.uri import SCHEMES, ModelRef, parse_ref

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
