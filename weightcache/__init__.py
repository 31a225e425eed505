"""weightcache: fetch each model once per node, hand it to pods read-only, load it at PCIe speed."""

__version__ = "0.1.0"
