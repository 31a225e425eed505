"""The header check's msgspec roads (typed tensors; the plain tree) give the same verdict and message as the
standard library's json road on every header: repeated keys (which msgspec silently collapses), escapes that hide
a colon or a quote, big integers, lone surrogates (which only json reads), metadata and nested extra fields."""

from __future__ import annotations

import contextlib
import io
import json
import struct
import sys
import typing
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from weightcache import safetensors_check
from weightcache.errors import SafetensorsHeaderError

ESCAPES = ["plain", "ascii", "colons", "colons upper", "all"]


def jstr(text: str, escape: str = "plain") -> str:
    """`text` as a JSON string, its characters written as the header's author chose: raw, \\uXXXX for non-ASCII,
    \\u003a for colons, or every character escaped."""
    if escape == "all":  # json.dumps escapes astral characters as surrogate pairs
        return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else json.dumps(c)[1:-1] for c in text) + '"'
    out = json.dumps(text, ensure_ascii=escape != "plain")
    if escape.startswith("colons"):
        out = out.replace(":", "\\u003A" if escape.endswith("upper") else "\\u003a")
    return out


def blob_of(header_text: str, data_len: int) -> bytes:
    body = header_text.encode("utf-8", "surrogatepass")  # a raw lone surrogate is invalid UTF-8: both refuse it
    return struct.pack("<Q", len(body)) + body + bytes(data_len)


# each road's stand-in for the typed road: on to the tree (then json where it cannot decide), or json at once
ROADS = {"all": None, "tree": safetensors_check._Next.TREE, "json": None}


def verdict(blob: bytes, *, roads: str = "all", build: bool = True) -> Any:
    """What the check says: the table and metadata, or the refusal's message. `roads`: all three; the tree road
    and json; json alone (the reference)."""
    f = io.BytesIO(blob)
    f.name = "/m/model.safetensors"
    with contextlib.ExitStack() as stack:
        if roads != "all":
            stack.enter_context(mock.patch.object(safetensors_check, "_check_typed", return_value=ROADS[roads]))
        try:
            header = safetensors_check._parse(f, len(blob), build=build)
        except SafetensorsHeaderError as exc:
            return "refused", str(exc)
    return "ok", list(header.tensors.items()), header.metadata, header.data_start


def assert_same(blob: bytes) -> Any:
    reference = verdict(blob, roads="json")
    assert verdict(blob) == reference
    assert verdict(blob, roads="tree") == reference
    assert verdict(blob, build=False)[0] == reference[0]  # the fetch's check: same verdict
    return reference


@contextlib.contextmanager
def forbidden(*roads: str) -> Iterator[None]:
    """These roads must not be taken ("json", "_check_tree"): an earlier one decided on its own."""
    with contextlib.ExitStack() as stack:
        for road in roads:
            target = (json, "loads") if road == "json" else (safetensors_check, road)
            stack.enter_context(mock.patch.object(*target, side_effect=AssertionError(f"{road} taken")))
        yield


# --- headers as text, so that keys can repeat and be spelled with escapes -------------------------------------

_pieces = st.sampled_from([*'ab:"\\ é', "\U0001f600", "\ud800", "data_offsets", "\\u003a", "dtype"])
_names = st.lists(_pieces, max_size=4).map("".join)
_escape = st.sampled_from(ESCAPES)
_key = st.builds(jstr, _names, _escape)
_scalar = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.sampled_from(["true", "false", "null", "1e400", "-0", "0.5"]),
    _key,
)
_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
    | st.lists(st.tuples(_key, inner), max_size=3).map(lambda kvs: "{" + ",".join(f"{k}:{v}" for k, v in kvs) + "}"),
    max_leaves=8,
)
_BITS = {"F32": 32, "I8": 8, "BF16": 16, "F4": 4}


@st.composite
def headers(draw: st.DrawFn) -> tuple[str, int]:
    """A consistent header (tensors back to back, sizes matching shapes), then perhaps spoilt: a field repeated,
    reordered, renamed by an escape, a number out of range or of another type, a pair repeated, metadata with
    colons, escapes or a repeated key, extra fields holding any JSON; and the data perhaps a byte off."""
    pairs: list[tuple[str, str]] = []
    pos = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        bits = _BITS[dtype]
        for d in shape:
            bits *= d
        if bits % 8:
            shape.append(2)
            bits *= 2
        size = bits // 8
        fields = [("dtype", jstr(dtype)), ("shape", json.dumps(shape)), ("data_offsets", json.dumps([pos, pos + size]))]
        pos += size
        if draw(st.integers(0, 5)) == 5:  # a number spoilt
            which = draw(st.sampled_from([1, 2]))
            spoilt = draw(st.sampled_from(["-1", "true", "1.0", str(2**63), str(2**70), '"1"', "{}", "[1]"]))
            items = json.loads(fields[which][1])
            fields[which] = (fields[which][0], "[" + ",".join([spoilt, *map(str, items[1:])]) + "]")
        if draw(st.integers(0, 5)) == 5:  # an extra field, ignored by the check
            fields.append((draw(_names), draw(_value)))
        if draw(st.integers(0, 5)) == 5:  # a field twice
            fields.append(draw(st.sampled_from(fields)))
        order = draw(st.permutations(range(len(fields))))
        body = ",".join(f"{jstr(fields[i][0], draw(_escape))}:{fields[i][1]}" for i in order)
        pairs.append((f"{i}{draw(_names)}", "{" + body + "}"))  # distinct names; repeats come below
    if draw(st.booleans()):
        meta = [(jstr(f"{i}{draw(_names)}", draw(_escape)),
                 draw(_value) if draw(st.integers(0, 5)) == 5 else draw(_key)) for i in range(draw(st.integers(0, 3)))]
        if meta and draw(st.integers(0, 3)) == 3:  # a metadata key twice
            meta.append((draw(st.sampled_from(meta))[0], draw(_key)))
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__",
                                                       "{" + ",".join(f"{k}:{v}" for k, v in meta) + "}"))
    if pairs and draw(st.integers(0, 4)) == 4:  # a pair twice
        pairs.append(draw(st.sampled_from(pairs)))
    sep = draw(st.sampled_from([(",", ":"), (", ", ": "), (",\n  ", " : ")]))
    text = "{" + sep[0].join(f"{jstr(k, draw(_escape))}{sep[1]}{v}" for k, v in pairs) + "}"
    text += " " * draw(st.integers(0, 3))  # the format allows padding
    return text, pos + draw(st.sampled_from([0, 0, 0, 1, -1]))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers())
@example(('{"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"I8","shape":[1],'
          '"data_offsets":[0,1]}}', 1))
def test_msgspec_and_json_agree_on_any_header(case: tuple[str, int]) -> None:
    text, data_len = case
    assert_same(blob_of(text, max(data_len, 0)))


_SIGNIFICANT = list(b':",{}[]\\u003aA 0-9e.')


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(headers(), st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["insert", "delete", "replace"]),
                                     st.sampled_from(_SIGNIFICANT)), min_size=1, max_size=3))
def test_msgspec_and_json_agree_on_mutated_bytes(case: tuple[str, int], edits: list[tuple[int, str, int]]) -> None:
    """Bytes inserted, deleted or replaced anywhere in the header (JSON's significant characters)."""
    text, data_len = case
    body = bytearray(text.encode("utf-8", "surrogatepass"))
    for at, how, byte in edits:
        i = at % (len(body) + 1)
        if how == "insert":
            body[i:i] = bytes([byte])
        elif i < len(body):
            body[i:i + 1] = b"" if how == "delete" else bytes([byte])
    assert_same(struct.pack("<Q", len(body)) + bytes(body) + bytes(max(data_len, 0)))


# --- cases the counting must get right, each of which a naive count gets wrong ---------------------------------


def t8(begin: int) -> str:
    """A one-byte tensor at `begin`."""
    return '{"dtype":"I8","shape":[1],"data_offsets":[' + f"{begin},{begin + 1}" + "]}"


def test_a_repeated_valid_tensor_is_refused_as_before() -> None:
    """msgspec keeps one of the two, which alone is a valid header: only the count says a pair was dropped."""
    ok, message = verdict(blob_of('{"a":' + t8(0) + ',"a":' + t8(0) + "}", 1))[:2]
    assert ok == "refused" and "duplicate key 'a'" in message


@pytest.mark.parametrize("escape", [r"\u003a", r"\u003A"])
def test_an_escaped_colon_does_not_hide_a_repeated_metadata_key(escape: str) -> None:
    """The escape decodes to a colon that has no ':' byte in the text: counted apart, or it would make up for the
    ':' of the dropped metadata pair and the header would pass with one of two values."""
    text = '{"__metadata__":{"k":"v","k":"w"},"x' + escape + '":' + t8(0) + "}"
    ok, message = verdict(blob_of(text, 1))[:2]
    assert ok == "refused" and "duplicate key 'k'" in message


def test_an_escaped_backslash_before_u003a_is_no_colon() -> None:
    r"""'\\u003a' is a backslash and the text u003a: counting it as a colon would miss a repeated key."""
    text = r'{"__metadata__":{"k":"v","k":"w","p":"\\u003a"},"x":' + t8(0) + "}"
    ok, message = verdict(blob_of(text, 1))[:2]
    assert ok == "refused" and "duplicate key 'k'" in message


def test_a_repeated_key_goes_from_the_typed_road_straight_to_json() -> None:
    """The tree would collapse it the same way: json names it, and the tree is not built for nothing; msgspec's
    count of keys says the repeat is at the top, so json's pairs are not made into a dict either."""
    blob = blob_of('{"a":' + t8(0) + ',"b":' + t8(1) + ',"a":' + t8(0) + "}", 2)
    with forbidden("_check_tree", "_object"):
        refused = verdict(blob)
    assert refused[0] == "refused" and "duplicate key 'a'" in refused[1]
    assert refused == verdict(blob, roads="json")


def test_a_repeated_field_inside_a_tensor_is_refused_as_before() -> None:
    text = '{"a":{"dtype":"F32","dtype":"I8","shape":[1],"data_offsets":[0,1]}}'
    ok, message = verdict(blob_of(text, 1))[:2]
    assert ok == "refused" and "tensor 'a' has a duplicate key 'dtype'" in message


def test_a_repeated_key_deep_in_an_extra_field_stays_accepted() -> None:
    """json's path refuses repeated keys in the header, its metadata and its tensors only; one deeper (in a field
    the check ignores) was accepted and still is (the count sends it to json, which decides)."""
    text = '{"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1],"x":{"k":1,"k":2}}}'
    assert assert_same(blob_of(text, 1))[0] == "ok"


def test_an_integer_past_64_bits_is_quoted_as_json_reads_it() -> None:
    """The message quotes the integer as written, whichever road refuses it."""
    text = '{"w":{"dtype":"F32","shape":[' + str(2**70) + ',0],"data_offsets":[0,0]}}'
    result = assert_same(blob_of(text, 0))
    assert result[0] == "refused" and str(2**70) in result[1] and "tensor 'w'" in result[1]


def test_a_lone_surrogate_name_is_read_by_json() -> None:
    """msgspec refuses a lone surrogate escape, json reads it: the header is valid, as before."""
    result = assert_same(blob_of(r'{"\ud800":' + t8(0) + "}", 1))
    assert result[0] == "ok" and result[1][0][0] == "\ud800"


def test_a_nesting_json_refuses_is_refused() -> None:
    """Recursion guards stop at the interpreter's recursion limit (1,000, or more where a library raised it: cel-python
    sets 2,500), at a depth that depends on the caller's stack: trees deeper than FAST_DEPTH are left to json, so
    such a header is refused as before, never accepted by another reading."""
    levels = sys.getrecursionlimit() + 10
    deep = "[" * levels + "]" * levels  # "__metadata__": null (valid) sends it past the typed road, to the tree
    text = '{"__metadata__":null,"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1],"x":' + deep + "}}"
    result = assert_same(blob_of(text, 1))
    assert result[0] == "refused" and "nested too deeply" in result[1]
    shallow = "[" * (safetensors_check.FAST_DEPTH - 3) + "]" * (safetensors_check.FAST_DEPTH - 3)
    with forbidden("json"):
        assert verdict(blob_of(text.replace(deep, shallow), 1))[0] == "ok"


# the road that decides each: typed tensors for valid headers of the usual form, the plain tree for the rest
FAST = {
    "plain": ('{"__metadata__":{"format":"pt"},"a":' + t8(0) + ',"b":' + t8(1) + "}", 2, "typed"),
    "colons in names and metadata": ('{"__metadata__":{"url":"s3://b/k:v"},"l:1":' + t8(1) + ',"l:2":' + t8(0)
                                     + "}", 2, "typed"),
    "escaped colon and quote": (r'{"a\u003ab\u0022":' + t8(0) + r',"\"data_offsets\"":' + t8(1) + "}", 2, "typed"),
    "fake escape": (r'{"a\\u003a":' + t8(0) + "}", 1, "typed"),
    "fields in any order": ('{"a":{"data_offsets":[0,4],"shape":[2,2],"dtype":"I8"}}', 4, "typed"),
    "empty tensors": ('{"e":{"dtype":"F32","shape":[0,3],"data_offsets":[1,1]},"a":' + t8(0) + ',"b":' + t8(1)
                      + "}", 2, "typed"),
    "no tensors": ('{"__metadata__":{}}', 0, "typed"),
    "extra field": ('{"__metadata__":null,"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1],"x":{"y":["z:",1.5]}}}',
                    1, "tree"),
    "refused: size": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', 4, "typed"),
    "refused: long shape": ('{"w":{"dtype":"I8","shape":[' + ",".join(["1"] * 100) + '],"data_offsets":[0,1]}}', 1,
                            "typed"),
    "refused: shape longer than the quote": ('{"w":{"dtype":"I8","shape":[' + ",".join(map(str, range(300))) +
                                             '],"data_offsets":[0,1]}}', 1, "typed"),
    "refused: wrong size before a long shape": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[1,5]},"w":'
                                                '{"dtype":"I8","shape":[' + ",".join(["1"] * 65) +
                                                '],"data_offsets":[0,1]}}', 5, "typed"),
    "refused: long shape before a wrong size": ('{"w":{"dtype":"I8","shape":[' + ",".join(["1"] * 65) +
                                                '],"data_offsets":[0,1]},"a":{"dtype":"F32","shape":[2],'
                                                '"data_offsets":[1,5]}}', 5, "typed"),
    "refused: gap": ('{"a":' + t8(0) + ',"b":' + t8(2) + "}", 3, "typed"),
    "refused: metadata not strings": ('{"__metadata__":{"k":1},"a":' + t8(0) + "}", 1, "tree"),
    "refused: unknown dtype": ('{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}', 16, "tree"),
    "escaped metadata key": (r'{"\u005f_metadata__":{"k":"v"},"a":' + t8(0) + "}", 1, "typed"),
    "refused: escaped metadata key shaped as a tensor": (r'{"\u005f_metadata__":' + t8(0) + "}", 1, "tree"),
    "refused: a tensor without dtype": ('{"__metadata__":{},"a":{"shape":[1],"data_offsets":[0,1]}}', 1, "tree"),
}


def test_the_typed_dtypes_are_the_known_dtypes() -> None:
    """msgspec checks a dtype against the Literal: it must hold exactly DTYPE_BITS's names."""
    assert list(typing.get_args(safetensors_check._DType)) == list(safetensors_check.DTYPE_BITS)


@pytest.mark.parametrize("case", list(FAST))
def test_real_and_hostile_headers_take_a_msgspec_road(case: str) -> None:
    """No json: msgspec and the count decide, accepting or refusing with json's own message; valid headers of
    the usual form on the typed road, without the plain tree."""
    text, data_len, road = FAST[case]
    blob = blob_of(text, data_len)
    reference = verdict(blob, roads="json")
    assert reference[0] == ("refused" if case.startswith("refused") else "ok")
    with forbidden("json", *(["_check_tree"] if road == "typed" else [])):
        assert verdict(blob) == reference


def test_threads_share_the_decoders_and_the_collector_pause() -> None:
    """The fetch engine checks files in worker threads at once: the module's decoders are shared and the cyclic
    collector is paused while any check runs; each thread still gets its own verdict, and collections come back."""
    import gc
    from concurrent.futures import ThreadPoolExecutor

    good = blob_of('{"__metadata__":{"k":"v:w"},"a":' + t8(0) + ',"b":' + t8(1) + "}", 2)
    many = blob_of("{" + ",".join(f'"t{i}":{t8(i)}' for i in range(20_000)) + "}", 20_000)
    bad = blob_of('{"a":' + t8(0) + ',"a":' + t8(0) + "}", 1)
    blobs = [good, many, bad] * 6
    expected = [verdict(blob)[0] for blob in blobs]
    assert expected[:3] == ["ok", "ok", "refused"]
    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(lambda blob: verdict(blob)[0], blobs)) == expected
    assert gc.isenabled()
