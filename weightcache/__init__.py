"""weightcache: fetch each model once per node, hand it to pods read-only, load it at PCIe speed."""

from __future__ import annotations

import functools


@functools.cache
def _installed_version() -> str:
    """The version is written once, in pyproject.toml; this reads it back from the installed distribution: the
    whole package (weightcache) or the pods' loader alone (weightcache-loader, packages/weightcache-loader).
    importlib.metadata (with the email package it loads) is imported here, on first use of `__version__`, not
    by every `import weightcache`: 40-60 ms of each CLI start and each pod's loader import."""
    from importlib.metadata import PackageNotFoundError, version

    for distribution in ("weightcache", "weightcache-loader"):
        try:
            return version(distribution)
        except PackageNotFoundError:
            continue
    return "0+unknown"  # a source tree run without being installed


def __getattr__(name: str) -> str:
    if name == "__version__":
        return _installed_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
