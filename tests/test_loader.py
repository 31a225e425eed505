"""The loader returns exactly what safetensors returns, zero-copy on cpu, and fails clearly on broken models."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.sample import make_model
from weightcache.errors import ModelFileNotFoundError, ModelLayoutError, SafetensorsHeaderError
from weightcache.loader import iter_tensors, load_state_dict

ROOT = Path(__file__).resolve().parents[1]
DTYPES = [getattr(torch, n) for n in (
    "bfloat16", "float16", "float32", "float64", "int8", "uint8", "int16", "int32", "int64", "bool", "complex64",
    "uint16", "uint32", "uint64", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
    "float8_e8m0fnu") if hasattr(torch, n)]
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def as_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert set(got) == set(want)
    for name, ref in want.items():
        t = got[name].cpu()
        assert (t.dtype, t.shape) == (ref.dtype, ref.shape), name
        assert as_bytes(t) == as_bytes(ref), name


@pytest.fixture(scope="module")
def every_dtype(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("dtypes") / "model.safetensors"
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dt in enumerate(DTYPES):
        raw = torch.randint(0, 256, (3, 7 + i, 2), generator=gen, dtype=torch.uint8)
        # Reinterpret random bytes so every bit pattern a dtype can hold is covered (bool must stay 0/1).
        tensors[str(dt)] = (raw % 2).bool() if dt == torch.bool else raw.view(-1)[: raw.numel() // dt.itemsize *
                                                                                    dt.itemsize].view(dt)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 5)
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("sharded")
    make_model(directory, layers=2, hidden=128, vocab=512, shards=3, dtype="float16")
    return directory


def reference(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def test_every_dtype_is_bit_exact_and_zero_copy(every_dtype: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the read-only buffer warning is handled, not leaked
        got = load_state_dict(every_dtype)
    assert_same(got, load_file(every_dtype))
    maps = Path("/proc/self/maps").read_text().splitlines()
    spans = [tuple(int(x, 16) for x in line.split()[0].split("-")) for line in maps if line.endswith(str(every_dtype))]
    t = got["torch.float32"]
    assert any(lo <= t.data_ptr() < hi for lo, hi in spans), "cpu tensors must be views of the file mapping"


def test_sharded_directory_index_and_single_file(sharded: Path) -> None:
    want = reference(sharded)
    assert_same(load_state_dict(sharded), want)
    assert_same(load_state_dict(sharded / "model.safetensors.index.json"), want)
    shard = sorted(sharded.glob("*.safetensors"))[1]
    assert_same(load_state_dict(shard), load_file(shard))
    names = [n for n, _ in iter_tensors(sharded)]
    index = json.loads((sharded / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(names) == sorted(index)


def test_keys_dtype_and_copy(sharded: Path) -> None:
    want = reference(sharded)
    keys = ["lm_head.weight", "model.norm.weight"]
    got = load_state_dict(sharded, keys=keys, dtype=torch.float32)
    assert set(got) == set(keys)
    for k in keys:
        assert got[k].dtype == torch.float32 and torch.equal(got[k], want[k].float())
    private = load_state_dict(sharded, keys=keys, copy=True)
    private["model.norm.weight"].add_(1)  # writable, and the file is not touched
    assert torch.equal(load_state_dict(sharded, keys=keys)["model.norm.weight"], want["model.norm.weight"])
    with pytest.raises(ModelLayoutError, match="not in the model"):
        load_state_dict(sharded, keys=["no.such.weight"])


def test_cold_page_cache_reads_back_exactly(sharded: Path) -> None:
    for f in sharded.glob("*.safetensors"):
        fd = os.open(f, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # evict just these files' pages
        os.close(fd)
    assert_same(load_state_dict(sharded), reference(sharded))


def test_plain_torch_module_loads_it_like_transformers_does(tmp_path: Path) -> None:
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    save_file(net.state_dict(), str(tmp_path / "model.safetensors"))
    fresh = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 4)).to(torch.bfloat16)
    fresh.load_state_dict(load_state_dict(tmp_path))
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    assert torch.equal(fresh(x), net(x))


def test_truncated_file_is_a_header_error(sharded: Path, tmp_path: Path) -> None:
    shard = sorted(sharded.glob("*.safetensors"))[0]
    bad = tmp_path / "model.safetensors"
    bad.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(SafetensorsHeaderError, match=r"model\.safetensors: .*truncated"):
        load_state_dict(tmp_path)


def test_malicious_header_is_refused_before_mapping(tmp_path: Path) -> None:
    header = json.dumps({"x": {"dtype": "F32", "shape": [1 << 40], "data_offsets": [0, 4 << 40]}}).encode()
    (tmp_path / "evil.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + bytes(16))
    with pytest.raises(SafetensorsHeaderError, match=r"evil\.safetensors: .*truncated"):
        load_state_dict(tmp_path)


def test_index_naming_a_missing_shard(sharded: Path, tmp_path: Path) -> None:
    for f in sharded.iterdir():
        if f.name != "model-00002-of-00003.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    with pytest.raises(ModelFileNotFoundError, match=r"model-00002-of-00003\.safetensors.*re-fetch"):
        load_state_dict(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd"])
def test_index_cannot_escape_the_model_directory(tmp_path: Path, shard: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": shard}}))
    with pytest.raises(ModelLayoutError, match="inside the model directory"):
        load_state_dict(tmp_path)


def test_bad_layouts_say_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ModelFileNotFoundError, match="mounted"):
        load_state_dict(tmp_path / "nope.safetensors")
    with pytest.raises(ModelLayoutError, match=r"no \*\.safetensors"):
        load_state_dict(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("[1, 2]")
    with pytest.raises(ModelLayoutError, match="weight_map"):
        load_state_dict(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    save_file({"w": torch.zeros(2)}, str(tmp_path / "a.safetensors"))
    save_file({"w": torch.ones(2)}, str(tmp_path / "b.safetensors"))
    with pytest.raises(ModelLayoutError, match="more than one file"):
        load_state_dict(tmp_path)


ALLOWED_IMPORTS = {"torch", "numpy", "safetensors", "weightcache", "msgspec"}  # msgspec: the header check's parser
ALLOWED_PACKAGE_MODULES = {"weightcache", "weightcache.loader", "weightcache.errors", "weightcache.safetensors_check",
                           "weightcache.vocabulary"}  # vocabulary: the streaming view's state file name


def test_loader_imports_only_stdlib_torch_and_its_own_helpers() -> None:
    for module in ("__init__", "loader", "safetensors_check", "errors", "vocabulary"):
        tree = ast.parse((ROOT / "weightcache" / f"{module}.py").read_text())
        for node in ast.walk(tree):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                top = name.split(".")[0]
                assert top in sys.stdlib_module_names or top in ALLOWED_IMPORTS, f"{module} imports {name}"
    code = ("import sys, weightcache.loader; "
            "print(sorted(m for m in sys.modules if m.startswith('weightcache'))); "
            "daemon = ('boto3', 'kubernetes', 'aiohttp', 'grpc', 'yaml', 'fsspec');"
            "print(sorted(m for m in daemon if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    package, third_party = (ast.literal_eval(line) for line in out.splitlines())
    assert set(package) <= ALLOWED_PACKAGE_MODULES and third_party == []


def test_header_check_needs_neither_torch_nor_numpy() -> None:
    code = "import sys, weightcache.safetensors_check; print('torch' in sys.modules or 'numpy' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


@cuda
@pytest.mark.cuda
@pytest.mark.parametrize("host_register", [None, True, False])
def test_cuda_matches_cpu(sharded: Path, host_register: bool | None) -> None:
    got = dict(iter_tensors(sharded, device="cuda", host_register=host_register))
    assert all(t.is_cuda for t in got.values())
    assert_same(got, reference(sharded))


@cuda
@pytest.mark.cuda
def test_cuda_every_dtype_and_conversion(every_dtype: Path) -> None:
    assert_same(load_state_dict(every_dtype, device="cuda"), load_file(every_dtype))
    half = load_state_dict(every_dtype, device="cuda", keys=["torch.float32"], dtype=torch.float16)
    assert half["torch.float32"].dtype == torch.float16 and half["torch.float32"].is_cuda
