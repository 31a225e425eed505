"""weightcache: fetch each model once per node, hand it to pods read-only, load it at PCIe speed."""

from weightcache.redact import redact_own_records

__version__ = "0.1.0"

redact_own_records()  # no record of ours carries a credential, whoever handles it
