"""The header check accepts what safetensors writes and refuses every malformed header with a named problem."""

from __future__ import annotations

import contextlib
import io
import json
import struct
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from weightcache import safetensors_check
from weightcache.errors import SafetensorsHeaderError
from weightcache.safetensors_check import MAX_HEADER_BYTES, check_file, parse_header


def raw_file(header: Any, data: bytes = b"", *, n: int | None = None) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return struct.pack("<Q", len(body) if n is None else n) + body + data


def check_bytes(blob: bytes, name: str = "model.safetensors") -> Any:
    f = io.BytesIO(blob)
    f.name = name
    return parse_header(f, len(blob))


def two_tensors() -> dict[str, Any]:
    return {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]},
        "b": {"dtype": "I8", "shape": [4], "data_offsets": [16, 20]},
    }


def test_accepts_what_safetensors_writes_with_absolute_offsets(tmp_path: Path) -> None:
    arrays: dict[str, np.ndarray[Any, Any]] = {
        "f16": np.arange(6, dtype=np.float16).reshape(2, 3), "f64": np.arange(3, dtype=np.float64),
        "i8": np.arange(5, dtype=np.int8), "u64": np.arange(2, dtype=np.uint64), "b": np.array([True, False]),
        "empty": np.zeros((0, 4), dtype=np.float32),
    }
    path = tmp_path / "m.safetensors"
    save_file(arrays, str(path), metadata={"format": "np"})
    check_file(path)
    header = parse_header(path, path.stat().st_size)
    blob = path.read_bytes()
    assert header.metadata == {"format": "np"}
    assert header.data_start == 8 + header.header_len
    assert set(header.tensors) == set(arrays)
    starts = [t.start for t in header.tensors.values()]
    assert starts == sorted(starts), "tensors come in file order"
    for name, arr in arrays.items():
        spec = header.tensors[name]
        assert spec.shape == arr.shape
        assert blob[spec.start:spec.end] == arr.tobytes(), name


def test_path_argument_and_sub_byte_dtype(tmp_path: Path) -> None:
    path = tmp_path / "f4.safetensors"
    path.write_bytes(raw_file({"x": {"dtype": "F4", "shape": [4], "data_offsets": [0, 2]}}, b"\x12\x34"))
    assert parse_header(path, path.stat().st_size).tensors["x"].nbytes == 2


def _with(**changes: Any) -> dict[str, Any]:
    h = two_tensors()
    for key, value in changes.items():
        if key == "a_":
            h["a"].update(value)
        else:
            h[key] = value
    return h


BAD: list[tuple[str, bytes, str]] = [
    ("tiny", b"\x01\x00", "fewer than the 8-byte"),
    ("len 1", raw_file(b"{", n=1), "outside 2.."),
    ("len huge", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}", "outside 2.."),
    ("len past end", raw_file(b"{}", n=50), "runs past the end"),
    ("not utf8", raw_file(b'{"\xff": 1}'), "not UTF-8"),
    ("not json", raw_file(b"{nope}"), "not valid JSON"),
    ("array", raw_file([1, 2]), "must be a JSON object"),
    ("nan", raw_file(b'{"a": NaN}'), "not valid JSON"),
    ("duplicate key", raw_file(b'{"a": {}, "a": {}}'), "duplicate key"),
    ("deep", raw_file(b"[" * 100_000 + b"]" * 100_000), "JSON"),
    ("metadata", raw_file(_with(__metadata__={"k": 1}), bytes(20)), "__metadata__"),
    ("dtype", raw_file(_with(a_={"dtype": "F128"}), bytes(20)), "unknown dtype"),
    ("shape neg", raw_file(_with(a_={"shape": [-2, -2]}), bytes(20)), "non-negative integers"),
    ("shape bool", raw_file(_with(a_={"shape": [True, 4]}), bytes(20)), "non-negative integers"),
    ("shape str", raw_file(_with(a_={"shape": "2x2"}), bytes(20)), "non-negative integers"),
    ("offsets 3", raw_file(_with(a_={"data_offsets": [0, 8, 16]}), bytes(20)), "data_offsets must be"),
    ("reversed", raw_file(_with(a_={"data_offsets": [16, 0]}), bytes(20)), "end before they begin"),
    ("size mismatch", raw_file(_with(a_={"shape": [3, 2]}), bytes(20)), "needs 24 bytes"),
    ("not object", raw_file(_with(a=[1]), bytes(20)), "must be an object"),
    ("gap", raw_file(_with(b={"dtype": "I8", "shape": [4], "data_offsets": [17, 21]}), bytes(21)), "gap of 1"),
    ("overlap", raw_file(_with(b={"dtype": "I8", "shape": [4], "data_offsets": [12, 16]}), bytes(20)), "overlaps"),
    ("truncated", raw_file(two_tensors(), bytes(19)), "truncated"),
    ("trailing", raw_file(two_tensors(), bytes(21)), "belong to no tensor"),
    ("f4 odd", raw_file({"x": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}}, bytes(2)), "needs 1.5 bytes"),
]


@pytest.mark.parametrize(("case", "blob", "problem"), BAD, ids=[b[0] for b in BAD])
def test_refuses_malformed_headers_naming_file_and_problem(case: str, blob: bytes, problem: str) -> None:
    with pytest.raises(SafetensorsHeaderError) as info:
        check_bytes(blob, name="/models/x/shard-3.safetensors")
    message = str(info.value)
    assert message.startswith("shard-3.safetensors: "), message
    assert problem in message
    assert "re-export or re-upload" in message


def test_valid_fixture_really_is_valid() -> None:
    header = check_bytes(raw_file(two_tensors(), bytes(20)))
    assert [(t.start - header.data_start, t.end - header.data_start) for t in header.tensors.values()] == [(0, 16),
                                                                                                          (16, 20)]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=400))
def test_random_bytes_only_raise_header_errors(blob: bytes) -> None:
    with contextlib.suppress(SafetensorsHeaderError):
        check_bytes(blob)


_json = st.recursive(
    st.none() | st.booleans() | st.integers(-3, 40) | st.floats(allow_nan=False) | st.text(max_size=5),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=4), inner, max_size=4),
    max_leaves=20,
)
_entry = st.fixed_dictionaries({
    "dtype": st.sampled_from(["F32", "I8", "BF16", "F4", "X", 3]),
    "shape": st.one_of(st.lists(st.integers(-1, 5), max_size=3), _json),
    "data_offsets": st.one_of(st.lists(st.integers(-1, 40), min_size=2, max_size=2), _json),
})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=6), st.one_of(_entry, _json), max_size=5), st.integers(0, 48))
def test_structured_headers_either_pass_consistently_or_raise_header_errors(header: dict[str, Any],
                                                                            data_len: int) -> None:
    blob = raw_file(header, bytes(data_len))
    try:
        parsed = check_bytes(blob)
    except SafetensorsHeaderError:
        return
    assert sum(t.nbytes for t in parsed.tensors.values()) == data_len
    assert all(parsed.data_start <= t.start <= t.end <= len(blob) for t in parsed.tensors.values())


HOSTILE_NUMBERS: list[tuple[str, dict[str, Any], str]] = [
    ("dim 2**70 beside a zero", {"dtype": "F32", "shape": [2**70, 0], "data_offsets": [0, 0]}, "below 2**63"),
    ("dims whose product overflows",
     {"dtype": "F32", "shape": [2**62] * 4, "data_offsets": [0, 16]}, "more bytes than the file holds"),
    ("offset 2**80", {"dtype": "I8", "shape": [4], "data_offsets": [0, 2**80]}, "data_offsets must be"),
    ("negative offset", {"dtype": "I8", "shape": [4], "data_offsets": [-4, 0]}, "data_offsets must be"),
    ("float dim", {"dtype": "I8", "shape": [4.0], "data_offsets": [0, 4]}, "non-negative integers"),
    ("bool offset", {"dtype": "I8", "shape": [1], "data_offsets": [False, True]}, "data_offsets must be"),
]


@pytest.mark.parametrize(("case", "entry", "problem"), HOSTILE_NUMBERS, ids=[h[0] for h in HOSTILE_NUMBERS])
def test_numbers_are_range_checked_before_arithmetic(case: str, entry: dict[str, Any], problem: str) -> None:
    with pytest.raises(SafetensorsHeaderError, match="tensor 'w'") as info:
        check_bytes(raw_file({"w": entry}, bytes(16)))
    assert problem in str(info.value)


def test_a_long_shape_is_refused_with_a_short_message() -> None:
    """200,000 dimensions of 2**62: one pass, bounded numbers; the message quotes a few dozen characters."""
    entry = {"dtype": "F32", "shape": [2**62] * 200_000, "data_offsets": [0, 16]}
    with pytest.raises(SafetensorsHeaderError, match="tensor 'w'") as info:
        check_bytes(raw_file({"w": entry}, bytes(16)))
    assert len(str(info.value)) < 500


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(-(2**80), 2**80), max_size=6), st.lists(st.integers(-(2**80), 2**80), max_size=3),
       st.sampled_from(["F32", "F4", "I8"]))
def test_any_integers_only_raise_header_errors(shape: list[int], offsets: list[int], dtype: str) -> None:
    try:
        parsed = check_bytes(raw_file({"w": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}, bytes(32)))
    except SafetensorsHeaderError:
        return
    assert all(0 <= d < 2**63 for t in parsed.tensors.values() for d in t.shape)


def _outcome(blob: bytes) -> Any:
    """The table, or the refusal's words: the column check must name the same tensor as the per-tensor check."""
    try:
        header = check_bytes(blob)
    except SafetensorsHeaderError as exc:
        return "refused", str(exc)
    return list(header.tensors.items()), header.metadata


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.dictionaries(st.text(max_size=6), st.one_of(_entry, _json), max_size=5), st.integers(0, 48))
def test_the_fast_column_check_agrees_with_the_per_tensor_check(header: dict[str, Any], data_len: int) -> None:
    """The column check (C builtins) must accept exactly what the per-tensor check accepts, with the same result."""
    blob = raw_file(header, bytes(data_len))
    with mock.patch.object(safetensors_check, "_columns", return_value=None):
        slow = _outcome(blob)
    assert _outcome(blob) == slow


@st.composite
def _near_valid(draw: st.DrawFn) -> tuple[dict[str, Any], int]:
    """Contiguous, consistent headers, sometimes with one number nudged: both checks must say the same."""
    header: dict[str, Any] = {}
    pos = 0
    for i in range(draw(st.integers(0, 5))):
        dtype = draw(st.sampled_from(["F32", "I8", "BF16", "F4"]))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        bits = safetensors_check.DTYPE_BITS[dtype]
        for d in shape:
            bits *= d
        size = bits // 8 if bits % 8 == 0 else -1
        if size < 0:
            continue
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + size]}
        pos += size
    data_len = pos
    nudge: bool = draw(st.booleans())
    if header and nudge:
        name = draw(st.sampled_from(sorted(header)))
        field = draw(st.sampled_from(["shape", "data_offsets", "data_len"]))
        delta = draw(st.sampled_from([-1, 1, 2**63, True]))
        if field == "data_len":
            data_len = max(0, data_len + (1 if delta is True else int(delta) % 3 - 1))
        elif field == "shape" and header[name]["shape"]:
            header[name]["shape"][0] = delta if delta is True else header[name]["shape"][0] + delta
        else:
            header[name]["data_offsets"][1] = header[name]["data_offsets"][1] + (0 if delta is True else delta)
    return header, data_len


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_near_valid())
def test_both_checks_agree_on_near_valid_headers(case: tuple[dict[str, Any], int]) -> None:
    header, data_len = case
    blob = raw_file(header, bytes(data_len))
    with mock.patch.object(safetensors_check, "_columns", return_value=None):
        slow = _outcome(blob)
    assert _outcome(blob) == slow
    try:  # the fetch's check (no tensor table built) accepts exactly the same
        safetensors_check._parse(io.BytesIO(blob), len(blob), build=False)
        check_only = "accepted"
    except SafetensorsHeaderError:
        check_only = "refused"
    assert check_only == ("refused" if slow[0] == "refused" else "accepted")


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 3)), max_size=5), st.integers(0, 12),
       st.permutations(range(5)))
@example([(0, 3), (1, 0)], 3, [0, 1, 2, 3, 4])  # an empty tensor inside another: refused, as the reference does
@example([(0, 2), (2, 0), (2, 1)], 3, [2, 1, 0, 3, 4])  # an empty tensor at a boundary: accepted
@example([(0, 2), (1, 2)], 3, [0, 1, 2, 3, 4])  # overlapping: refused
def test_both_checks_agree_on_overlaps_gaps_and_any_order(spans: list[tuple[int, int]], data_len: int,
                                                         order: list[int]) -> None:
    """Every tensor's size matches its shape, so only the layout decides: overlapping, gapped, empty tensors
    sharing an offset, any order in the JSON. The column check sorts begins and ends apart (and by pairs when a
    tensor is empty); it must accept exactly the contiguous tilings the per-tensor check accepts."""
    names = [f"t{i}" for i in order if i < len(spans)]
    header = {name: {"dtype": "I8", "shape": [size], "data_offsets": [begin, begin + size]}
              for name, (begin, size) in zip(names, spans, strict=False)}
    blob = raw_file(header, bytes(data_len))
    with mock.patch.object(safetensors_check, "_columns", return_value=None):
        slow = _outcome(blob)
    assert _outcome(blob) == slow
    try:
        safetensors_check._parse(io.BytesIO(blob), len(blob), build=False)
        check_only = "accepted"
    except SafetensorsHeaderError:
        check_only = "refused"
    assert check_only == ("refused" if slow[0] == "refused" else "accepted")
