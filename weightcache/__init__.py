"""weightcache: fetch each model once per node, hand it to pods read-only, load it at PCIe speed."""

from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as _version


def _installed_version() -> str:
    """The version is written once, in pyproject.toml; this reads it back from the installed distribution: the
    whole package (weightcache) or the pods' loader alone (weightcache-loader, packages/weightcache-loader)."""
    for distribution in ("weightcache", "weightcache-loader"):
        try:
            return _version(distribution)
        except PackageNotFoundError:
            continue
    return "0+unknown"  # a source tree run without being installed


__version__ = _installed_version()
