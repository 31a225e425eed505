"""CPU tensors are copy-on-write views: zero-copy until written, an in-place op works (no SIGSEGV) and never reaches
the file; and an index that lies about its shards or is built to crash the parser is a clear error."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.sample import make_model
from weightcache.errors import ModelLayoutError
from weightcache.loader import INDEX_NAME, MAX_INDEX_BYTES, load_state_dict


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("cow")
    make_model(directory, layers=2, hidden=64, vocab=128, shards=2, dtype="float32")
    for f in directory.glob("*.safetensors"):
        f.chmod(0o444)  # like a published snapshot: the loader must not need write access
    return directory


def digests(directory: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(directory.glob("*.safetensors"))}


IN_PLACE = textwrap.dedent("""
    import sys, torch
    from weightcache.loader import load_state_dict

    def mapped_file(ptr):
        # the file a virtual address is mapped from, per /proc/self/maps ('' for anonymous memory)
        for line in open("/proc/self/maps"):
            fields = line.split()
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= ptr < hi:
                return fields[5] if len(fields) > 5 else ""
        return None

    state = load_state_dict(sys.argv[1])
    name = "model.embed_tokens.weight"
    t = state[name]
    before = t.clone()
    where = mapped_file(t.data_ptr())
    assert where and where.endswith(".safetensors"), where  # zero-copy: a view of the file's mapping
    t.add_(1)                                                # in place: SIGSEGV with a read-only mapping
    state["model.norm.weight"].mul_(0)
    assert torch.equal(t, before + 1)
    assert not state["model.norm.weight"].any()
    again = load_state_dict(sys.argv[1])                     # a new load sees the file's bytes, unchanged
    assert torch.equal(again[name], before)
    print("ok")
""")


def test_in_place_ops_work_and_never_reach_the_file(model: Path) -> None:
    before = digests(model)
    done = subprocess.run([sys.executable, "-c", IN_PLACE, str(model)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr[-2000:])
    assert digests(model) == before


def test_untouched_tensors_are_still_views_of_one_mapping(model: Path) -> None:
    state = load_state_dict(model)
    a, b = state["model.layers.0.self_attn.q_proj.weight"], state["model.layers.0.self_attn.k_proj.weight"]
    assert a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()  # no per-tensor copies
    copied = load_state_dict(model, copy=True)["model.layers.0.self_attn.q_proj.weight"]
    assert copied.untyped_storage().data_ptr() != a.untyped_storage().data_ptr() and torch.equal(copied, a)


def write_index(directory: Path, weight_map: dict[str, str]) -> None:
    (directory / INDEX_NAME).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def test_index_mapping_a_tensor_to_a_shard_without_it_is_an_error(model: Path, tmp_path: Path) -> None:
    index = json.loads((model / INDEX_NAME).read_text())["weight_map"]
    shards = sorted(set(index.values()))
    for f in model.iterdir():
        (tmp_path / f.name).write_bytes(f.read_bytes())
    moved = next(n for n, s in index.items() if s == shards[0])
    write_index(tmp_path, {**index, moved: shards[1]})  # the tensor really lives in shards[0]
    with pytest.raises(ModelLayoutError, match=rf"maps 1 tensors to {shards[1]}.*{moved}"):
        load_state_dict(tmp_path)
    write_index(tmp_path, {**index, "lm_head.extra": shards[0]})  # a tensor no shard has
    with pytest.raises(ModelLayoutError, match=r"lm_head\.extra"):
        load_state_dict(tmp_path)


def test_deeply_nested_index_is_an_error_not_a_recursion_error(model: Path, tmp_path: Path) -> None:
    shard = next(model.glob("*.safetensors"))
    (tmp_path / shard.name).write_bytes(shard.read_bytes())
    depth = 100_000
    (tmp_path / INDEX_NAME).write_text('{"weight_map": ' + "[" * depth + "]" * depth + "}")
    with pytest.raises(ModelLayoutError, match="nested too deeply"):
        load_state_dict(tmp_path)


def test_oversized_index_is_refused_without_reading_it(model: Path, tmp_path: Path) -> None:
    shard = next(model.glob("*.safetensors"))
    (tmp_path / shard.name).write_bytes(shard.read_bytes())
    with open(tmp_path / INDEX_NAME, "wb") as fh:
        fh.truncate(MAX_INDEX_BYTES + 1)  # sparse: costs no disk
    with pytest.raises(ModelLayoutError, match="larger than"):
        load_state_dict(tmp_path)


def test_loaded_values_match_safetensors(model: Path) -> None:
    from safetensors.torch import load_file

    want: dict[str, torch.Tensor] = {}
    for f in sorted(model.glob("*.safetensors")):
        want.update(load_file(f))
    got = load_state_dict(model)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_loader_refuses_what_the_stores_header_check_refuses(tmp_path: Path) -> None:
    """One check for both (weightcache.safetensors_check): a shape the store refuses never reaches torch here."""
    import struct

    from weightcache.errors import SafetensorsHeaderError
    from weightcache.safetensors_check import check_file

    header = json.dumps({"a": {"dtype": "F32", "shape": [2**70, 0], "data_offsets": [0, 0]}}).encode()
    path = tmp_path / "m.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header)
    with pytest.raises(SafetensorsHeaderError) as by_store:
        check_file(path)
    with pytest.raises(SafetensorsHeaderError) as by_loader:
        load_state_dict(path)
    assert str(by_loader.value) == str(by_store.value)
