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


class FetchCancelledError(StoreError):
    """A fetch was cancelled (Ctrl-C, daemon shutdown); finished chunks are kept and resume on the next run."""


class InsufficientSpaceError(StoreError):
    """The model does not fit in the byte budget or on the disk, even after eviction."""


class DamagedRecordError(StoreError):
    """A manifest, ref, lease or pin on disk is not what the store writes (bad JSON, digest, path or size)."""


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


class AnnotationError(WeightcacheError, ValueError):
    """A pod's `weightcache.io/*` annotation is malformed; the message shows what to write instead."""


class InjectionConflictError(WeightcacheError, ValueError):
    """A pod already uses a volume name, mount path or env var that the webhook would inject."""


class BadAdmissionReviewError(WeightcacheError, ValueError):
    """A webhook request is not an AdmissionReview v1 for a Pod CREATE (answered with HTTP 400)."""


class InvalidRequestError(WeightcacheError, ValueError):
    """A request lacks a required field or carries a malformed one; `field` names it as the caller wrote it."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class VolumeConflictError(WeightcacheError, FileExistsError):
    """A volume id is already published with other arguments (other model, target or pod)."""


class OperationPendingError(WeightcacheError, BlockingIOError):
    """Another operation on the same volume is still running; retry after it finishes."""


class FetchPendingError(WeightcacheError, TimeoutError):
    """The model is still downloading past the bounded wait; the message carries its progress. Retry later."""


class VolumeNotFoundError(WeightcacheError, LookupError):
    """No published volume has that id (or it is not published at that path)."""


class MountError(WeightcacheError, OSError):
    """A bind mount or unmount failed, or the mount table does not show what we asked for."""


class BackendMissingError(WeightcacheError, ImportError):
    """A source scheme needs an optional package that is not installed (the message names the pip command)."""


class ClusterError(WeightcacheError, OSError):
    """The Kubernetes API refused or failed a request; `status` is the HTTP status (0 when unreachable)."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class ModelLayoutError(WeightcacheError, ValueError):
    """A model directory or its index is inconsistent (bad index, duplicate or unknown tensor names)."""


class ModelFileNotFoundError(WeightcacheError, FileNotFoundError):
    """A model file the loader needs (the path itself or a shard the index names) is missing."""
