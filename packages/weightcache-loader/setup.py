"""Build weightcache-loader from the repository's weightcache/ directory: only the modules the loader imports.

One source of truth: the package directory is ../../weightcache itself, and the version is read from the root
pyproject.toml. A module added to the loader's imports must be added to LOADER_MODULES; tests/test_loader_dist.py
builds the wheel and loads a model with it in a fresh environment without the rest of weightcache, so a missing one
fails there.
"""

import tomllib
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
# weightcache/__init__.py comes with any module of the package
LOADER_MODULES = ["weightcache.loader", "weightcache.errors", "weightcache.safetensors_check", "weightcache.vocabulary"]

setup(
    version=tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"],
    package_dir={"weightcache": "../../weightcache"},
    py_modules=LOADER_MODULES,
)
