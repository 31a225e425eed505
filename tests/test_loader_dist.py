"""weightcache-loader (packages/weightcache-loader): built from the repository's own weightcache/ files, installed by
pip into a fresh venv that holds nothing of weightcache, and a real safetensors model loaded through it.

The fresh venv sees torch (and torch's own dependencies) from this environment through a .pth naming a directory
of links to them, the same reuse `--system-site-packages` gives where the base interpreter has torch (here it does
not): installing the 190 MB torch wheel again would take most of a minute. Nothing else of this environment is
visible there, so boto3, the daemon and the rest of weightcache cannot be imported, and a loader import that
needs them fails here.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from importlib.metadata import Distribution, PackageNotFoundError, distribution, version
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "packages" / "weightcache-loader"
MODULES = {"weightcache/__init__.py", "weightcache/loader.py", "weightcache/errors.py",
           "weightcache/safetensors_check.py", "weightcache/vocabulary.py"}


@contextlib.contextmanager
def _built_once(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The wheel directory of this test run, held under a lock: every xdist worker that runs one of these tests
    shares it, so each wheel is built once per run, never by two workers at once (setuptools builds in the source
    tree, packages/*/build and *.egg-info: two concurrent builds of one tree failed). Without xdist, this process's."""
    uid = getattr(request.config, "workerinput", {}).get("testrunuid")
    out = tmp_path_factory.getbasetemp().parent / f"wheels-{uid}" if uid else tmp_path_factory.getbasetemp() / "wheels"
    out.mkdir(exist_ok=True)
    with (out / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield out


def _pip_wheel(out: Path, *sources: Path, timeout: float) -> None:
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), *map(str, sources)], capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, done.stderr


@pytest.fixture(scope="module")
def wheel(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    with _built_once(request, tmp_path_factory) as out:
        if not list(out.glob("weightcache_loader-*.whl")):
            _pip_wheel(out, PACKAGE, timeout=120)
        (found,) = out.glob("weightcache_loader-*.whl")
    return found


def test_the_wheel_is_the_repository_files_and_depends_on_torch_only(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if not n.startswith("weightcache_loader-")}
        assert names == MODULES  # not the daemon, the store, the sources...
        for name in MODULES:  # one source of truth: the very bytes of weightcache/
            assert z.read(name) == (ROOT / name).read_bytes(), name
        (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(z.read(meta_name).decode())
    assert meta["Name"] == "weightcache-loader"
    assert meta["Version"] == version("weightcache")  # the root pyproject.toml's version
    assert [r.split(">")[0].split("=")[0].strip() for r in meta.get_all("Requires-Dist")] == ["torch"]


def _closure(name: str, seen: dict[str, Distribution]) -> None:
    """torch and what it requires (unconditionally), as installed here."""
    key = name.lower().replace("_", "-")
    if key in seen:
        return
    try:
        dist = distribution(name)
    except PackageNotFoundError:
        return  # an optional dependency this environment lacks: torch does without it here too
    seen[key] = dist
    for req in dist.requires or []:
        if "extra ==" in req:
            continue
        _closure(req.split(";")[0].split("[")[0].split(">")[0].split("<")[0].split("=")[0].split("!")[0].strip(), seen)


def _torch_only_site(where: Path) -> Path:
    """A directory of links to torch and its dependencies' top-level files, and nothing else of this venv."""
    where.mkdir()
    seen: dict[str, Distribution] = {}
    _closure("torch", seen)
    for dist in seen.values():
        for f in dist.files or []:
            top = f.parts[0]
            if top in ("..", "__pycache__"):  # console scripts in bin/, byte code
                continue
            src = Path(str(dist.locate_file(top)))
            link = where / top
            if src.exists() and not link.exists():
                link.symlink_to(src)
    assert not (where / "weightcache").exists() and not (where / "boto3").exists()
    return where


def _venv_with_torch_only(base: Path) -> Path:
    """A fresh venv (its python) that sees torch and torch's dependencies from this environment, nothing else."""
    venv = base / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    python = venv / "bin" / "python"
    purelib = Path(subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                                  capture_output=True, text=True, check=True).stdout.strip())
    (purelib / "torch-from-the-test-env.pth").write_text(str(_torch_only_site(base / "torch-site")) + "\n")
    return python


@pytest.fixture(scope="module")
def fresh_python(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    python = _venv_with_torch_only(tmp_path_factory.mktemp("fresh"))
    # pip of this environment installs into the fresh one (--python), as `pip install weightcache_loader-*.whl`
    # there would; --no-deps: its one dependency, torch, is already visible
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps",
                           "--no-index", str(wheel)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return python


@pytest.fixture(scope="module")
def wheelhouse(wheel: Path, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The three distributions as wheels in one directory, as the release workflow builds them."""
    with _built_once(request, tmp_path_factory) as out:
        if not list(out.glob("weightcache_vllm-*.whl")):
            _pip_wheel(out, ROOT / "packages" / "weightcache-vllm", ROOT, timeout=300)
    return out


def test_the_three_distributions_have_one_version(wheelhouse: Path) -> None:
    metas = {}
    for whl in wheelhouse.glob("*.whl"):
        with zipfile.ZipFile(whl) as z:
            (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
            meta = Parser().parsestr(z.read(meta_name).decode())
        metas[meta["Name"]] = meta
    assert {name: m["Version"] for name, m in metas.items()} == {
        name: version("weightcache") for name in ("weightcache", "weightcache-loader", "weightcache-vllm")}
    # the plugin needs the loader of its own release, not whatever `weightcache-loader` an index has
    assert f"weightcache-loader=={version('weightcache')}" in metas["weightcache-vllm"].get_all("Requires-Dist")


def test_weightcache_vllm_installs_from_the_wheelhouse_alone(wheelhouse: Path, tmp_path: Path) -> None:
    """`pip install --no-index --find-links WHEELHOUSE weightcache-vllm` in an image that has torch (and vLLM):
    the plugin and its loader come from the wheelhouse, nothing from an index."""
    python = _venv_with_torch_only(tmp_path)
    done = subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
                           "--find-links", str(wheelhouse), "weightcache-vllm"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    probe = ("import json, importlib.metadata as m, weightcache.loader, weightcache_vllm; print(json.dumps({"
             "'vllm': m.version('weightcache-vllm'), 'loader': m.version('weightcache-loader'), "
             "'plugins': [e.value for e in m.entry_points(group='vllm.general_plugins')], "
             "'file': weightcache.loader.__file__}))")
    done = subprocess.run([str(python), "-I", "-c", probe], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["vllm"] == got["loader"] == version("weightcache")
    assert sorted(got["plugins"]) == ["weightcache_vllm.lora_resolver:register", "weightcache_vllm:register"]
    assert got["file"].startswith(str(tmp_path))


PROBE = """
import importlib.util, json, sys
import weightcache, weightcache.loader
from weightcache.loader import load_state_dict
sd = load_state_dict(sys.argv[1])
print(json.dumps({
    "file": weightcache.__file__, "version": weightcache.__version__,
    "tensors": {k: [str(v.dtype), list(v.shape), float(v.double().sum())] for k, v in sorted(sd.items())},
    "importable": [m for m in ("weightcache.daemon", "weightcache.store", "boto3", "safetensors")
                if importlib.util.find_spec(m) is not None],
}))
"""


def test_a_model_loads_through_the_installed_wheel_alone(fresh_python: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    model.mkdir()
    torch.manual_seed(0)
    tensors = {"embed.weight": torch.randn(64, 32, dtype=torch.bfloat16), "lm_head.bias": torch.arange(7.0),
               "norm.weight": torch.ones(32, dtype=torch.float16)}
    save_file(tensors, str(model / "model.safetensors"))
    done = subprocess.run([str(fresh_python), "-I", "-c", PROBE, str(model)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # -I and cwd: the repository's weightcache/ is not on the path
    assert done.returncode == 0, done.stderr
    got = json.loads(done.stdout)
    assert got["file"].startswith(str(fresh_python.parent.parent)), got["file"]
    assert got["version"] == version("weightcache")
    assert got["importable"] == []  # nothing of the daemon, nor the libraries it needs
    assert got["tensors"] == {k: [str(v.dtype), list(v.shape), float(v.double().sum())]
                              for k, v in sorted(tensors.items())}
