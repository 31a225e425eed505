"""The header check refuses exactly what safetensors' own Rust parser refuses (differential, against
safetensors.deserialize, on named cases, generated headers and mutated bytes), with a named problem; big headers
are checked in one child process with a memory limit and a timeout; a fetch refuses a bad header with exit 7."""

from __future__ import annotations

import io
import json
import struct
import subprocess
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from safetensors.numpy import save_file

from weightcache import safetensors_check
from weightcache.errors import SafetensorsHeaderError, StoreError
from weightcache.safetensors_check import MAX_HEADER_BYTES, check_file, parse_header


def blob_of(text: str | bytes, data_len: int, *, n: int | None = None) -> bytes:
    body = text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass")  # raw surrogates: bad UTF-8
    return struct.pack("<Q", len(body) if n is None else n) + body + bytes(max(data_len, 0))


def t8(begin: int) -> str:
    """A one-byte tensor at `begin`."""
    return '{"dtype":"I8","shape":[1],"data_offsets":[' + f"{begin},{begin + 1}" + "]}"


def ours(blob: bytes) -> Any:
    """("ok", {name: (dtype, shape, bytes)}) or ("refused", message)."""
    f = io.BytesIO(blob)
    f.name = "/models/x/shard-3.safetensors"
    try:
        header = parse_header(f, len(blob))
    except SafetensorsHeaderError as exc:
        return "refused", str(exc)
    return "ok", {k: (t.dtype, list(t.shape), blob[t.start:t.end]) for k, t in header.tensors.items()}


def rust(blob: bytes) -> Any:
    try:
        tensors = safetensors.deserialize(blob)  # type: ignore[no-untyped-call]  # the package has no stubs
    except Exception as exc:  # SafetensorError, and a panic's PanicException (a BaseException subclass: not caught)
        return "refused", str(exc)
    return "ok", {k: (v["dtype"], v["shape"], bytes(v["data"])) for k, v in tensors}


def assert_as_rust(blob: bytes) -> Any:
    """Our verdict is the reference's, and an accepted file's tensors are the same names, types, shapes and bytes."""
    mine, theirs = ours(blob), rust(blob)
    assert mine[0] == theirs[0], (mine, theirs)
    if mine[0] == "ok":
        assert mine[1] == theirs[1]
        assert list(mine[1]) == sorted(mine[1], key=list(mine[1]).index)  # file order, checked via bytes below
    else:
        assert mine[1].startswith("shard-3.safetensors: invalid safetensors file: ") and "re-export" in mine[1]
    return mine


def extra(value: str) -> str:
    """A valid one-tensor header with a field the format ignores holding `value`."""
    return '{"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1],"x":' + value + "}}"


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


I8_2 = '{"dtype":"I8","shape":[2],"data_offsets":[0,2]}'
# (header text, data bytes, accepted?, words of our refusal)
CASES: dict[str, tuple[str, int, bool, str]] = {
    "plain": ('{"__metadata__":{"format":"pt"},"a":' + t8(0) + ',"b":' + t8(1) + "}", 2, True, ""),
    "no tensors": ("{}", 0, True, ""),
    "padding": ('{"a":' + t8(0) + "}  \n\t\r", 1, True, ""),
    "whitespace inside": ('{ "a" :\n' + t8(0) + " }", 1, True, ""),
    "form feed after": ('{"a":' + t8(0) + "}\x0c", 1, False, "not valid JSON"),
    "nul after": ('{"a":' + t8(0) + "}\x00", 1, False, "not valid JSON"),
    "byte order mark": ('\ufeff{"a":' + t8(0) + "}", 1, False, "not valid JSON"),
    "empty": ("", 0, False, "not valid JSON"),
    "two values": ('{"a":' + t8(0) + "}{}", 1, False, "not valid JSON"),
    "array": ("[]", 0, False, "must be a JSON object"),
    "string": ('"x"', 0, False, "must be a JSON object"),
    "lone surrogate in metadata": ('{"__metadata__":{"k":"\\ud800"},"a":' + t8(0) + "}", 1, False, "lone surrogate"),
    "lone low surrogate in a name": ('{"\\udc00":' + t8(0) + "}", 1, False, "lone surrogate"),
    "lone surrogate in an ignored field": (extra('"\\udbff\\u0041"'), 1, False, "lone surrogate"),
    "surrogates split by a backslash": ('{"\\ud800\\\\\\udc00":' + t8(0) + "}", 1, False, "lone surrogate"),
    "surrogate pair": ('{"\\ud83d\\ude00":' + t8(0) + "}", 1, True, ""),
    "escaped backslash before ud800": ('{"\\\\ud800":' + t8(0) + "}", 1, True, ""),
    "raw surrogate bytes": ('{"\ud800":' + t8(0) + "}", 1, False, "not UTF-8"),
    "repeated name, last wins": ('{"a":' + t8(1) + ',"a":' + t8(0) + "}", 1, True, ""),
    "repeated name, last is wrong": ('{"a":' + t8(0) + ',"a":' + t8(1) + "}", 1, False, "gap of 1"),
    "repeated name, the first badly sized": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]},"a":' + t8(0)
                                             + "}", 1, True, ""),
    "repeated name, the first malformed": ('{"a":{"dtype":"X","shape":[1],"data_offsets":[0,1]},"a":' + t8(0) + "}",
                                           1, False, "unknown dtype"),
    "repeated field": ('{"a":{"dtype":"F32","dtype":"I8","shape":[1],"data_offsets":[0,1]}}', 1, False,
                       "repeats its field 'dtype'"),
    "repeated ignored field": (extra('1,"x":2'), 1, True, ""),
    "repeated metadata": ('{"__metadata__":null,"__metadata__":{"k":"v"},"a":' + t8(0) + "}", 1, False,
                          "'__metadata__' 2 times"),
    "repeated metadata key, last wins": ('{"__metadata__":{"k":"v","k":"w"},"a":' + t8(0) + "}", 1, True, ""),
    "escaped metadata name": ('{"\\u005f_metadata__":{"k":"v"},"a":' + t8(0) + "}", 1, True, ""),
    "metadata null": ('{"__metadata__":null,"a":' + t8(0) + "}", 1, True, ""),
    "metadata number": ('{"__metadata__":{"k":1},"a":' + t8(0) + "}", 1, False, "map strings to strings"),
    "metadata list": ('{"__metadata__":[],"a":' + t8(0) + "}", 1, False, "must be an object"),
    "tensor as array": ('{"a":["I8",[1],[0,1]]}', 1, True, ""),
    "tensor as array of 4": ('{"a":["I8",[1],[0,1],5]}', 1, False, "must be an object"),
    "tensor null": ('{"a":null}', 0, False, "must be an object"),
    "tensor without data_offsets": ('{"a":{"dtype":"I8","shape":[1]}}', 1, False, "no field 'data_offsets'"),
    "dtype as an enum map": ('{"a":{"dtype":{"I8":null},"shape":[1],"data_offsets":[0,1]}}', 1, True, ""),
    "dtype map of two": ('{"a":{"dtype":{"I8":null,"I8":null},"shape":[1],"data_offsets":[0,1]}}', 1, False,
                         "unknown dtype"),
    "dtype map not null": ('{"a":{"dtype":{"I8":1},"shape":[1],"data_offsets":[0,1]}}', 1, False, "unknown dtype"),
    "dtype lower case": ('{"a":{"dtype":"i8","shape":[1],"data_offsets":[0,1]}}', 1, False, "unknown dtype"),
    "dtype F128": ('{"a":{"dtype":"F128","shape":[1],"data_offsets":[0,16]}}', 16, False, "unknown dtype"),
    "dim -0": ('{"a":{"dtype":"I8","shape":[-0],"data_offsets":[0,0]}}', 0, False, "shape must be"),
    "offset -0": ('{"a":{"dtype":"I8","shape":[0],"data_offsets":[-0,0]}}', 0, False, "data_offsets must be"),
    "-0 in a name only": ('{"v-0":' + t8(0) + "}", 1, True, ""),
    "dim 1.0": ('{"a":{"dtype":"I8","shape":[1.0],"data_offsets":[0,1]}}', 1, False, "shape must be"),
    "dim true": ('{"a":{"dtype":"I8","shape":[true],"data_offsets":[0,1]}}', 1, False, "shape must be"),
    "dim -1": ('{"a":{"dtype":"I8","shape":[-1],"data_offsets":[0,1]}}', 1, False, "shape must be"),
    "dim 2**64-1 beside a zero": ('{"a":{"dtype":"I8","shape":[' + str(2**64 - 1) + ',0],"data_offsets":[0,0]}}', 0,
                                  True, ""),
    "dim 2**64": ('{"a":{"dtype":"I8","shape":[' + str(2**64) + ',0],"data_offsets":[0,0]}}', 0, False,
                  "shape must be"),
    "overflow before a zero": ('{"a":{"dtype":"I8","shape":[' + str(2**63) + ',2,0],"data_offsets":[0,0]}}', 0,
                               False, "more than 2**64 bits"),
    "zero before an overflow": ('{"a":{"dtype":"I8","shape":[0,' + str(2**63) + ',2],"data_offsets":[0,0]}}', 0,
                                True, ""),
    "bits overflow": ('{"a":{"dtype":"F64","shape":[' + str(2**61) + '],"data_offsets":[0,0]}}', 0, False,
                      "more than 2**64 bits"),
    "65 dims": ('{"a":{"dtype":"I8","shape":[' + ",".join(["1"] * 65) + '],"data_offsets":[0,1]}}', 1, True, ""),
    "no dims": ('{"a":{"dtype":"I8","shape":[],"data_offsets":[0,1]}}', 1, True, ""),
    "size mismatch": ('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', 4, False, "needs 8 bytes"),
    "F4 of 3": ('{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}', 2, False, "not a whole number of bytes"),
    "F4 of 4": ('{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}', 2, True, ""),
    "offsets of 3": ('{"a":{"dtype":"I8","shape":[1],"data_offsets":[0,1,2]}}', 1, False, "data_offsets must be"),
    "offsets reversed": ('{"a":{"dtype":"I8","shape":[0],"data_offsets":[1,0]}}', 1, False, "needs 0 bytes"),
    "gap": ('{"a":' + t8(0) + ',"b":' + t8(2) + "}", 3, False, "gap of 1"),
    "overlap": ('{"a":' + I8_2 + ',"b":' + t8(1) + "}", 2, False, "overlaps"),
    "gap at the start": ('{"a":' + t8(1) + "}", 2, False, "gap of 1"),
    "empty tensor inside another": ('{"a":' + I8_2 + ',"e":{"dtype":"I8","shape":[0],"data_offsets":[1,1]}}', 2,
                                    False, "overlaps"),
    "empty tensor at the end": ('{"a":' + I8_2 + ',"e":{"dtype":"I8","shape":[0],"data_offsets":[2,2]}}', 2,
                                True, ""),
    "empty tensor past the end": ('{"a":' + I8_2 + ',"e":{"dtype":"I8","shape":[0],"data_offsets":[3,3]}}', 2,
                                  False, "gap of 1"),
    "out of order": ('{"b":' + t8(1) + ',"a":' + t8(0) + "}", 2, True, ""),
    "data left over": ('{"a":' + t8(0) + "}", 2, False, "belong to no tensor"),
    "data short": ('{"a":' + t8(0) + "}", 0, False, "truncated"),
    "data but no tensors": ("{}", 1, False, "belong to no tensor"),
    "1e400 ignored": (extra("1e400"), 1, False, "too large for a float64"),
    "-1.8e308 ignored": (extra("[-1.8e308]"), 1, False, "too large for a float64"),
    "1.7976931348623157e308 ignored": (extra("1.7976931348623157e308"), 1, True, ""),
    "1e-400 ignored": (extra("1e-400"), 1, True, ""),
    "309-digit integer ignored": (extra("1" + "0" * 308), 1, True, ""),
    "310-digit integer ignored": (extra('{"k":-1' + "0" * 309 + "}"), 1, False, "too large for a float64"),
    "5000-digit integer ignored": (extra("9" * 5000), 1, False, "not valid JSON"),
    "NaN ignored": (extra("NaN"), 1, False, "not valid JSON"),
    "control character": (extra('"a\x01"'), 1, False, "not valid JSON"),
    "leading zero": (extra("01"), 1, False, "not valid JSON"),
    "trailing comma": (extra("[1,]"), 1, False, "not valid JSON"),
    "nested 127 deep": (extra(nested(125)), 1, True, ""),
    "nested 128 deep": (extra(nested(126)), 1, False, "nested deeper than 127"),
    "nested 128 deep in objects": (extra('{"k":' * 126 + "1" + "}" * 126), 1, False, "nested deeper than 127"),
    "nested past Python's limit": (extra(nested(5000)), 1, False, "nested deeper than 127"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_refuses_what_safetensors_refuses(case: str) -> None:
    text, data_len, accepted, words = CASES[case]
    verdict = assert_as_rust(blob_of(text, data_len))
    assert verdict[0] == ("ok" if accepted else "refused")
    assert words in (verdict[1] if not accepted else "")


LENGTHS: dict[str, tuple[bytes, str]] = {
    "7 bytes": (b"\x02\x00\x00\x00\x00\x00\x00", "fewer than the 8-byte"),
    "length 0": (blob_of(b"", 0), "not valid JSON"),
    "length 1": (blob_of(b"{", 0), "not valid JSON"),
    "length past the end": (blob_of(b"{}", 0, n=50), "runs past the end"),
    "length over the limit": (blob_of(b"{}", 0, n=MAX_HEADER_BYTES + 1), "over the format's"),
    "length 2**64-1": (blob_of(b"{}", 0, n=2**64 - 1), "over the format's"),
}


@pytest.mark.parametrize("case", list(LENGTHS))
def test_header_length_bounds_are_the_references(case: str) -> None:
    blob, words = LENGTHS[case]
    verdict = assert_as_rust(blob)
    assert verdict[0] == "refused" and words in verdict[1]


def test_accepts_what_safetensors_writes_in_file_order(tmp_path: Path) -> None:
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
    assert header.metadata == {"format": "np"} and header.data_start == 8 + header.header_len
    starts = [t.start for t in header.tensors.values()]
    assert starts == sorted(starts) and set(header.tensors) == set(arrays)
    for name, arr in arrays.items():
        assert header.tensors[name].shape == arr.shape
        assert blob[header.tensors[name].start:header.tensors[name].end] == arr.tobytes(), name


# --- generated headers: as text, so that keys repeat, escapes hide characters and numbers take any spelling -------

_pieces = st.sampled_from([*'ab:"\\ é', "\U0001f600", "\ud800", "\udc00", "-0", "\\u003a", "dtype", "__metadata__"])
_names = st.lists(_pieces, max_size=4).map("".join)


def jstr(text: str, escape: str) -> str:
    """`text` as a JSON string: raw (a lone surrogate then makes bad UTF-8) or with \\uXXXX escapes."""
    if escape == "all":
        return '"' + "".join(f"\\u{ord(c):04x}" if ord(c) < 0x10000 else json.dumps(c)[1:-1] for c in text) + '"'
    return json.dumps(text, ensure_ascii=escape == "ascii")


_key = st.builds(jstr, _names, st.sampled_from(["plain", "ascii", "all"]))
_scalar = st.one_of(
    st.integers(-(2**70), 2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(json.dumps),
    st.sampled_from(["true", "false", "null", "1e400", "-0", "0.5", "1" + "0" * 309, "-1.8e308", "1e-400"]),
    _key,
)
_value = st.recursive(
    _scalar,
    lambda inner: st.lists(inner, max_size=3).map(lambda xs: "[" + ",".join(xs) + "]")
    | st.lists(st.tuples(_key, inner), max_size=3).map(lambda kvs: "{" + ",".join(f"{k}:{v}" for k, v in kvs) + "}")
    | st.sampled_from([nested(124), nested(125), nested(126)]),
    max_leaves=6,
)
_BITS = {"F32": 32, "I8": 8, "BF16": 16, "F4": 4, "F6_E2M3": 6}
_SPOILT = ["-1", "-0", "true", "1.0", "1e0", str(2**63), str(2**64 - 1), str(2**64), '"1"', "{}", "[1]", "null"]


@st.composite
def headers(draw: st.DrawFn) -> tuple[str, int]:
    """A consistent header (tensors in any order, sizes matching shapes), then perhaps spoilt: a number or dtype
    changed, a field repeated or dropped, an ignored field holding any JSON, the array form, a pair or the metadata
    repeated, metadata of other types; and the data perhaps a byte off."""
    pairs: list[tuple[str, str]] = []
    pos = 0
    for i in range(draw(st.integers(0, 4))):
        dtype = draw(st.sampled_from(sorted(_BITS)))
        shape = draw(st.lists(st.integers(0, 4), max_size=3))
        bits = _BITS[dtype]
        for d in shape:
            bits *= d
        while bits % 8:
            shape.append(2)
            bits *= 2
        size = bits // 8
        dtype_text = draw(st.sampled_from([json.dumps(dtype), '{"' + dtype + '":null}', '"F128"']))
        fields = [["dtype", dtype_text], ["shape", json.dumps(shape)], ["data_offsets", json.dumps([pos, pos + size])]]
        pos += size
        if draw(st.integers(0, 5)) == 5:  # a number spoilt
            which = draw(st.sampled_from([1, 2]))
            items = json.loads(fields[which][1]) or [0]
            fields[which][1] = "[" + ",".join([draw(st.sampled_from(_SPOILT)), *map(str, items[1:])]) + "]"
        if draw(st.integers(0, 7)) == 7:  # as an array
            pairs.append((f"{i}{draw(_names)}", "[" + ",".join(v for _, v in fields) + "]"))
            continue
        if draw(st.integers(0, 4)) == 4:  # an ignored field
            fields.append([draw(_names), draw(_value)])
        if draw(st.integers(0, 7)) == 7:  # a field twice
            fields.append(draw(st.sampled_from(fields)))
        if draw(st.integers(0, 9)) == 9:  # a field dropped
            fields.pop(draw(st.integers(0, len(fields) - 1)))
        order = draw(st.permutations(range(len(fields))))
        body = ",".join(f"{json.dumps(fields[i][0])}:{fields[i][1]}" for i in order)
        pairs.append((f"{i}{draw(_names)}", "{" + body + "}"))
    if draw(st.booleans()):
        meta = [(jstr(f"m{i}{draw(_names)}", "plain"), draw(_key) if draw(st.integers(0, 5)) else draw(_value))
                for i in range(draw(st.integers(0, 3)))]
        if meta and draw(st.integers(0, 3)) == 3:  # a metadata key twice
            meta.append((draw(st.sampled_from(meta))[0], draw(_key)))
        value = draw(st.sampled_from(["{" + ",".join(f"{k}:{v}" for k, v in meta) + "}", "null", "[]", '"x"']))
        pairs.insert(draw(st.integers(0, len(pairs))), ("__metadata__", value))
    if pairs and draw(st.integers(0, 4)) == 4:  # a pair twice (the metadata too: refused)
        pairs.insert(draw(st.integers(0, len(pairs))), draw(st.sampled_from(pairs)))
    pairs = [pairs[i] for i in draw(st.permutations(range(len(pairs))))] if draw(st.booleans()) else pairs
    sep = draw(st.sampled_from([(",", ":"), (", ", ": "), (",\n  ", " : ")]))
    text = "{" + sep[0].join(f"{jstr(k, 'plain')}{sep[1]}{v}" for k, v in pairs) + "}"
    text += draw(st.sampled_from(["", " ", "\n\t\r ", "\x0c", "\x00"]))  # padding, and what is not
    return text, pos + draw(st.sampled_from([0, 0, 0, 1, -1]))


FAST = settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@FAST
@given(headers())
@example(('{"a":' + t8(0) + ',"a":' + t8(0) + "}", 1))
def test_generated_headers_get_the_references_verdict(case: tuple[str, int]) -> None:
    assert_as_rust(blob_of(*case))


_SIGNIFICANT = list(b':",{}[]\\u0-9eE.- \x00\xff\xed')  # \xed: how a raw surrogate's UTF-8 starts


@FAST
@given(headers(), st.lists(st.tuples(st.integers(0, 10**6), st.sampled_from(["insert", "delete", "replace"]),
                                     st.sampled_from(_SIGNIFICANT)), min_size=1, max_size=3))
def test_mutated_bytes_get_the_references_verdict(case: tuple[str, int], edits: list[tuple[int, str, int]]) -> None:
    """Bytes inserted, deleted or replaced anywhere in the header (JSON's significant characters, bad UTF-8)."""
    text, data_len = case
    body = bytearray(text.encode("utf-8", "surrogatepass"))
    for at, how, byte in edits:
        i = at % (len(body) + 1)
        if how == "insert":
            body[i:i] = bytes([byte])
        elif i < len(body):
            body[i:i + 1] = b"" if how == "delete" else bytes([byte])
    assert_as_rust(blob_of(bytes(body), data_len))


@settings(max_examples=200, deadline=None, derandomize=True)
@given(st.lists(st.integers(0, 2**64), max_size=6), st.lists(st.integers(0, 2**64), max_size=3),
       st.sampled_from(["F32", "F4", "I8", "F64"]))
def test_any_integers_get_the_references_verdict(shape: list[int], offsets: list[int], dtype: str) -> None:
    """Products past 64 bits, zeros before or after them: serde's checked fold from the left."""
    assert_as_rust(blob_of(json.dumps({"w": {"dtype": dtype, "shape": shape, "data_offsets": offsets}}), 32))


# --- hostile headers: linear time, short messages ----------------------------------------------------------------


def test_a_long_shape_is_refused_at_once_with_a_short_message() -> None:
    """200,000 dimensions of 2**62: no big-number arithmetic; the message quotes a few dozen characters."""
    text = json.dumps({"w": {"dtype": "F32", "shape": [2**62] * 200_000, "data_offsets": [0, 16]}})
    verdict = ours(blob_of(text, 16))
    assert verdict[0] == "refused" and "tensor 'w'" in verdict[1] and len(verdict[1]) < 500


# --- big headers: one child process ------------------------------------------------------------------------------


def big(tmp_path: Path, count: int, *, spoil: bool = False, name: str = "model.safetensors") -> Path:
    pairs = [f'"t{i:07d}":{t8(i)}' for i in range(count)]
    if spoil:
        pairs[-1] = pairs[-1].replace('"I8"', '"I16"')
    path = tmp_path / name
    path.write_bytes(blob_of('{"__metadata__":{"format":"pt"},' + ",".join(pairs) + "}", count))
    return path


def test_a_big_header_is_checked_in_a_child_and_never_parsed_here(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Over CHILD_MIN_BYTES: this process (the daemon's) never decodes it, so it never holds the GIL for it; the
    child gets no credentials from the environment, and the verdict and words are the in-process check's."""
    count = safetensors_check.CHILD_MIN_BYTES // 50 + 100
    good, bad = big(tmp_path, count), big(tmp_path, count, spoil=True, name="bad.safetensors")
    assert struct.unpack("<Q", good.read_bytes()[:8])[0] > safetensors_check.CHILD_MIN_BYTES
    in_process = ours(bad.read_bytes())[1].replace("shard-3", "bad")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-secret")
    environments: list[dict[str, str]] = []
    real_run = subprocess.run

    def spy(*args: Any, **kwargs: Any) -> Any:
        environments.append(kwargs["env"])
        return real_run(*args, **kwargs)

    monkeypatch.setattr(subprocess, "run", spy)
    monkeypatch.setattr(json, "loads", lambda *a, **k: pytest.fail("parsed in the checking process"))
    check_file(good)
    with pytest.raises(SafetensorsHeaderError) as refused:
        check_file(bad)
    assert str(refused.value) == in_process and f"'t{count - 1:07d}'" in in_process
    assert len(environments) == 2 and all("hunter2-secret" not in env.values() for env in environments)


@pytest.fixture
def every_header_in_a_child(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(safetensors_check, "CHILD_MIN_BYTES", 2)


@pytest.mark.usefixtures("every_header_in_a_child")
@pytest.mark.parametrize(("setting", "value", "words"), [
    ("CHILD_MEMORY_BYTES", 1 << 20, r"exited with status 1 \(MemoryError\).*more memory"),  # the 2 MB header
    ("CHILD_TIMEOUT_S", 0.001, r"took over 0 s and was stopped"),
])
def test_a_child_out_of_memory_or_time_is_an_error_never_a_verdict(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                   setting: str, value: float, words: str) -> None:
    monkeypatch.setattr(safetensors_check, setting, value)
    with pytest.raises(StoreError, match=rf"model\.safetensors: .*{words}"):
        check_file(big(tmp_path, 40_000))


@pytest.mark.usefixtures("every_header_in_a_child")
def test_a_weightcache_package_in_the_working_directory_is_not_what_the_child_runs(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    planted = tmp_path / "cwd" / "weightcache"
    planted.mkdir(parents=True)
    marker = tmp_path / "ran"
    for module in ("__init__.py", "safetensors_check.py"):
        (planted / module).write_text(f"open({str(marker)!r}, 'w').close()\n")
    path = big(tmp_path, 10)
    monkeypatch.chdir(planted.parent)
    check_file(path)
    assert not marker.exists()


@pytest.mark.usefixtures("every_header_in_a_child")
def test_big_headers_are_checked_one_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each child may take GBs: a source of many big headers must not start them by the dozen."""
    running, most, lock, real_run = [0], [0], threading.Lock(), subprocess.run

    def counted(*args: Any, **kwargs: Any) -> Any:
        with lock:
            running[0] += 1
            most[0] = max(most[0], running[0])
        try:
            return real_run(*args, **kwargs)
        finally:
            with lock:
                running[0] -= 1

    monkeypatch.setattr(subprocess, "run", counted)
    paths = [big(tmp_path, 10, name=f"{i}.safetensors") for i in range(3)]
    threads = [threading.Thread(target=check_file, args=(p,)) for p in paths]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert most[0] == 1


def test_a_fetch_refuses_a_big_hostile_header_with_exit_7(tmp_path: Path) -> None:
    """No patching: a header over CHILD_MIN_BYTES, as the fetch engine meets it; nothing published or left."""
    from tests.grants import granted
    from weightcache.fetch import Fetcher
    from weightcache.store import Store

    count = safetensors_check.CHILD_MIN_BYTES // 50 + 100
    src = tmp_path / "src"
    src.mkdir()
    big(src, count, spoil=True)
    (src / "config.json").write_text(json.dumps({"a": 1}))
    fetcher = Fetcher(Store(tmp_path / "root"))
    with pytest.raises(SafetensorsHeaderError, match=rf"model\.safetensors.*'t{count - 1:07d}'") as refused:
        fetcher.ensure(granted(f"file://{src}/"))
    assert refused.value.answer.exit_code == 7
    assert fetcher.store.list() == []
    assert not list(fetcher.store.layout.partial.glob("*.part"))


def test_threads_checking_at_once_each_get_their_own_verdict() -> None:
    """The fetch engine checks files in worker threads at once."""
    from concurrent.futures import ThreadPoolExecutor

    good = blob_of('{"__metadata__":{"k":"v:w"},"a":' + t8(0) + ',"b":' + t8(1) + "}", 2)
    many = blob_of("{" + ",".join(f'"t{i}":{t8(i)}' for i in range(20_000)) + "}", 20_000)
    bad = blob_of('{"a":' + t8(0) + ',"a":' + t8(1) + "}", 1)
    blobs = [good, many, bad] * 6
    with ThreadPoolExecutor(6) as pool:
        assert [v[0] for v in pool.map(ours, blobs)] == ["ok", "ok", "refused"] * 6
