"""The fetch engine: `Fetcher.ensure(grant)` turns a reference into a published snapshot (engine.py), by phase:
plan.py, transfer.py, publish.py; handover.py streams files to a caller as they become durable."""

from weightcache.errors import FetchCancelledError
from weightcache.fetch.engine import Fetcher
from weightcache.fetch.handover import DurableFile
from weightcache.fetch.plan import source_revision
from weightcache.progress import Progress

__all__ = ["DurableFile", "FetchCancelledError", "Fetcher", "Progress", "source_revision"]
