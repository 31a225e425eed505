"""One exception module for the whole package.

Domain errors also subclass the builtin they resemble, so callers that only know the builtin still catch them,
and each boundary (CLI exit code, HTTP status, gRPC code) translates them with one table.
Messages never contain credentials and always say what to do next.
"""

from __future__ import annotations


class WeightcacheError(Exception):
    """Base of every error we raise on purpose."""


class InvalidReferenceError(WeightcacheError, ValueError):
    """A model reference (URI, revision, glob) is malformed."""


class HostileKeyError(WeightcacheError, ValueError):
    """An object key would escape the snapshot or cannot be a path."""

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"refusing object key {key!r}: {reason}; fix or remove that object in the source")
        self.key = key
        self.reason = reason


class SafetensorsHeaderError(WeightcacheError, ValueError):
    """A .safetensors file's header is malformed or inconsistent with the file."""


class SourceError(WeightcacheError, OSError):
    """The object store failed in a way retries did not fix."""


class SourceNotFoundError(SourceError, FileNotFoundError):
    """The bucket, prefix or object does not exist (or lists no objects)."""


class SourceAccessDeniedError(SourceError, PermissionError):
    """The credentials in use may not read the bucket or object."""


class ObjectChangedError(SourceError):
    """The object was replaced while we downloaded it (ETag or version changed)."""


class RetriesExceededError(SourceError):
    """Bounded retries ran out; `last_exception` is the final failure."""

    def __init__(self, message: str, last_exception: BaseException | None = None) -> None:
        super().__init__(message)
        self.last_exception = last_exception


class IntegrityError(WeightcacheError, ValueError):
    """Downloaded bytes do not match the checksum the source or a sidecar declares."""


class StoreError(WeightcacheError, OSError):
    """The on-disk store cannot do what was asked."""


class InsufficientSpaceError(StoreError):
    """The model does not fit in the byte budget or on the disk, even after eviction."""


class NotCachedError(StoreError, LookupError):
    """No snapshot is cached for that reference or id."""


class InUseError(StoreError):
    """A snapshot is leased or pinned and may not be evicted."""


class NotAllowedError(WeightcacheError, PermissionError):
    """Policy refuses this namespace the model (no ModelCache declares it for the namespace)."""


class ConfigError(WeightcacheError, ValueError):
    """A configuration file or value is invalid."""


class MemoryTierError(WeightcacheError, OSError):
    """The memory tier cannot lock pages (RLIMIT_MEMLOCK, cgroup limit, budget)."""
