"""The version is the repository's (the root pyproject.toml), and the loader it needs is that same release: one
version from one place for the three distributions (tests/test_loader_dist.py builds and installs them)."""

import tomllib
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).resolve().parent.parent.parent
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]

setup(version=VERSION, install_requires=[f"weightcache-loader=={VERSION}", "torch>=2.1"])
