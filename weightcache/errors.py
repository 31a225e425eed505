"""One exception module for the whole package, and how each boundary answers each exception.

Every error we raise on purpose names its own `answer`: the CLI's exit code, the daemon API's HTTP status and the
gRPC code (CSI). Boundaries call `answer_for(exc)`; anything that is not a WeightcacheError is unexpected
(exit 1, HTTP 500, INTERNAL) and logged with its traceback. tests/test_errors.py checks that every subclass,
wherever it is defined, declares its own answer, and that docs/errors.md (the table for operators) agrees.

Exit codes: 0 ok, 1 unexpected, 2 bad input, 3 not cached / not found, 4 in use, 5 no space, 6 object store or
Kubernetes API failure, 7 integrity failure (a missing or failed signature too), 8 refused by policy, 9 still in
progress elsewhere (retry), 130 interrupted (partial downloads are kept).

Domain errors also subclass the builtin they resemble (ValueError, PermissionError, ...), so callers that only know
the builtin still catch them; store errors are deliberately not OSErrors, so an `except OSError` around file work
never swallows "not cached" or "in use". Messages never contain credentials and always say what to do next.
"""

from __future__ import annotations

from typing import ClassVar, NamedTuple


class Answer(NamedTuple):
    exit_code: int  # the CLI
    http_status: int  # the daemon API
    grpc_code: str  # a grpc.StatusCode name (CSI); a name, so the loader in pods needs no grpc


UNEXPECTED = Answer(1, 500, "INTERNAL")


def answer_for(exc: BaseException) -> Answer:
    """How every boundary answers `exc`."""
    return exc.answer if isinstance(exc, WeightcacheError) else UNEXPECTED


class WeightcacheError(Exception):
    """Base of every error we raise on purpose."""

    answer: ClassVar[Answer] = UNEXPECTED


class InvalidReferenceError(WeightcacheError, ValueError):
    """A model reference (URI, revision, glob) is malformed."""
    answer = Answer(2, 400, "INVALID_ARGUMENT")


class HostileKeyError(WeightcacheError, ValueError):
    """An object key would escape the snapshot or cannot be a path."""
    answer = Answer(2, 502, "FAILED_PRECONDITION")

    def __init__(self, key: str, reason: str) -> None:
        super().__init__(f"refusing object key {key!r}: {reason}; fix or remove that object in the source")
        self.key = key
        self.reason = reason


class SafetensorsHeaderError(WeightcacheError, ValueError):
    """A .safetensors file's header is malformed or inconsistent with the file."""
    answer = Answer(7, 502, "FAILED_PRECONDITION")


class SourceError(WeightcacheError, OSError):
    """The object store failed in a way retries did not fix."""
    answer = Answer(6, 502, "UNAVAILABLE")


class SourceNotFoundError(SourceError, FileNotFoundError):
    """The bucket, prefix or object does not exist (or lists no objects)."""
    answer = Answer(6, 502, "NOT_FOUND")


class SourceAccessDeniedError(SourceError, PermissionError):
    """The credentials in use may not read the bucket or object."""
    answer = Answer(6, 502, "PERMISSION_DENIED")


class ObjectChangedError(SourceError):
    """The object was replaced while we downloaded it (ETag or version changed)."""
    answer = Answer(6, 502, "UNAVAILABLE")


class RetriesExceededError(SourceError):
    """Bounded retries ran out; `last_exception` is the final failure."""
    answer = Answer(6, 502, "UNAVAILABLE")

    def __init__(self, message: str, last_exception: BaseException | None = None) -> None:
        super().__init__(message)
        self.last_exception = last_exception


class IntegrityError(WeightcacheError, ValueError):
    """Downloaded bytes do not match the checksum the source or a sidecar declares."""
    answer = Answer(7, 502, "UNAVAILABLE")


class SignatureError(IntegrityError):
    """A model that must be signed has no model.sig, or one that does not verify or does not match its files."""
    answer = Answer(7, 422, "FAILED_PRECONDITION")


class StoreError(WeightcacheError):
    """The on-disk store cannot do what was asked."""
    answer = Answer(1, 500, "INTERNAL")


class FetchCancelledError(StoreError):
    """A fetch was cancelled (Ctrl-C, daemon shutdown); finished chunks are kept and resume on the next run."""
    answer = Answer(130, 503, "ABORTED")


class InsufficientSpaceError(StoreError):
    """The model does not fit in the byte budget or on the disk, even after eviction."""
    answer = Answer(5, 507, "RESOURCE_EXHAUSTED")


class DamagedRecordError(StoreError):
    """A manifest, ref, lease or pin on disk is not what the store writes (bad JSON, digest, path or size)."""
    answer = Answer(7, 500, "INTERNAL")


class NewerRecordError(StoreError):
    """A node-state record (CSI volume, DRA claim) was written by a release with a newer major record version; it
    is kept as it is and its leases held."""
    answer = Answer(1, 500, "FAILED_PRECONDITION")


class NotCachedError(StoreError, LookupError):
    """No snapshot is cached for that reference or id."""
    answer = Answer(3, 404, "NOT_FOUND")


class InUseError(StoreError):
    """A snapshot is leased or pinned and may not be evicted."""
    answer = Answer(4, 409, "FAILED_PRECONDITION")


class BlobMissingError(StoreError):
    """A blob the fetch planned to reuse vanished before publish (evicted meanwhile): plan again."""
    answer = Answer(1, 503, "ABORTED")  # the fetch replans by itself; seen outside only if that keeps failing


class NotAllowedError(WeightcacheError, PermissionError):
    """Policy refuses this namespace the model (no ModelCache declares it for the namespace)."""
    answer = Answer(8, 403, "PERMISSION_DENIED")


class ConfigError(WeightcacheError, ValueError):
    """A configuration file or value is invalid."""
    answer = Answer(2, 400, "FAILED_PRECONDITION")


class MemoryTierError(WeightcacheError, OSError):
    """The memory tier cannot lock pages (RLIMIT_MEMLOCK, cgroup limit, budget)."""
    answer = Answer(5, 507, "RESOURCE_EXHAUSTED")


class AnnotationError(WeightcacheError, ValueError):
    """A pod's `weightcache.io/*` annotation is malformed; the message shows what to write instead."""
    answer = Answer(2, 400, "INVALID_ARGUMENT")


class InjectionConflictError(WeightcacheError, ValueError):
    """A pod already uses a volume name, mount path or env var that the webhook would inject."""
    answer = Answer(2, 409, "ALREADY_EXISTS")


class BadAdmissionReviewError(WeightcacheError, ValueError):
    """A webhook request is not an AdmissionReview v1 for a Pod CREATE (answered with HTTP 400)."""
    answer = Answer(2, 400, "INVALID_ARGUMENT")


class InvalidRequestError(WeightcacheError, ValueError):
    """A request lacks a required field or carries a malformed one; `field` names it as the caller wrote it."""
    answer = Answer(2, 400, "INVALID_ARGUMENT")

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field


class VolumeConflictError(WeightcacheError, FileExistsError):
    """A volume id is already published with other arguments (other model, target or pod)."""
    answer = Answer(4, 409, "ALREADY_EXISTS")


class OperationPendingError(WeightcacheError, BlockingIOError):
    """Another operation on the same volume is still running; retry after it finishes."""
    answer = Answer(9, 409, "ABORTED")


class FetchPendingError(WeightcacheError, TimeoutError):
    """The model is still downloading past the bounded wait; the message carries its progress. Retry later."""
    answer = Answer(9, 503, "UNAVAILABLE")


class StreamFailedError(WeightcacheError):
    """The node's fetch behind a streaming view failed; the message carries the daemon's error text."""
    answer = Answer(6, 502, "UNAVAILABLE")


class VolumeNotFoundError(WeightcacheError, LookupError):
    """No published volume has that id (or it is not published at that path)."""
    answer = Answer(3, 404, "NOT_FOUND")


class MountError(WeightcacheError, OSError):
    """A bind mount or unmount failed, or the mount table does not show what we asked for."""
    answer = Answer(1, 500, "INTERNAL")


class BackendMissingError(WeightcacheError, ImportError):
    """A source scheme needs an optional package that is not installed (the message names the pip command)."""
    answer = Answer(2, 501, "FAILED_PRECONDITION")


class ClusterError(WeightcacheError, OSError):
    """The Kubernetes API refused or failed a request; `status` is the HTTP status (0 when unreachable)."""
    answer = Answer(6, 502, "UNAVAILABLE")

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class PolicyNotListedError(ClusterError):
    """A namespace's request would be refused while this node has not yet listed the cluster's ModelCaches (its
    watch's first list is pending, e.g. just after a restart): not a decision yet, so a retryable UNAVAILABLE, not
    PERMISSION_DENIED naming a ModelCache that may well exist."""
    answer = Answer(9, 503, "UNAVAILABLE")


class ModelLayoutError(WeightcacheError, ValueError):
    """A model directory or its index is inconsistent (bad index, duplicate or unknown tensor names)."""
    answer = Answer(7, 422, "FAILED_PRECONDITION")


class ModelFileNotFoundError(WeightcacheError, FileNotFoundError):
    """A model file the loader needs (the path itself or a shard the index names) is missing."""
    answer = Answer(3, 404, "NOT_FOUND")
