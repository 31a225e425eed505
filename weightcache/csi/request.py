"""A NodePublishVolume request, validated field by field in the spec's order (pure: no I/O): INVALID_ARGUMENT
naming the field for each thing wrong, the pod's volumeAttributes read into `PublishArgs` and its volume kind."""

from __future__ import annotations

import os
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

from weightcache.csi._pb import csi_pb2
from weightcache.csi.reconcile import VolumeKind, VolumeRecord
from weightcache.csi.telemetry import Pod
from weightcache.engine_name import EngineName
from weightcache.errors import InvalidReferenceError, InvalidRequestError
from weightcache.uri import ModelRef, parse_globs, parse_ref, validate_repo_id
from weightcache.vocabulary import ADAPTERS_ATTRIBUTE, ENGINE_CACHE_ATTRIBUTE, REPORT_ATTRIBUTE, STREAM_ATTRIBUTE

POD_NAMESPACE, POD_NAME, POD_UID = (f"csi.storage.k8s.io/pod.{k}" for k in ("namespace", "name", "uid"))
TIERS = ("disk", "memory")
MAX_ID_BYTES = 128  # the CSI spec's size limit for ids
MAX_TIMEOUT_S = 600.0
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m)?$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, None: 1.0}


@dataclass(frozen=True)
class PublishArgs:
    """A validated NodePublishVolume request."""

    volume_id: str
    target_path: str
    ref: ModelRef
    tier: str
    timeout: float | None  # seconds, from volume_context.timeout
    pod_namespace: str
    pod_name: str
    pod_uid: str
    hf_repo: str | None = None  # volume_context.hfRepo: mount the snapshot as a hub cache for this repo
    engine_cache: EngineName | None = None  # volume_context.engineCache: the pod's engine cache, not the model
    readonly: bool = True
    stream: bool = False  # volume_context.stream: on a miss, a view that fills while the model downloads
    adapters: bool = False  # volume_context.adapters: the model's LoRA adapters, not the model (csi/adapters.py)
    report: bool = False  # volume_context.report: the pod's report volume, not the model (csi/engine_volumes.py)

    @property
    def pod(self) -> Pod:
        return Pod(self.pod_namespace, self.pod_name, self.pod_uid)

    @property
    def kind(self) -> VolumeKind:
        if self.engine_cache is not None:
            return VolumeKind.ENGINE_CACHE
        if self.adapters:
            return VolumeKind.ADAPTERS
        if self.report:
            return VolumeKind.REPORT
        return VolumeKind.STREAM if self.stream else VolumeKind.MODEL

    def record(self, snapshot_id: str, *, handover: bool = False) -> VolumeRecord:
        return VolumeRecord(self.volume_id, self.target_path, str(self.ref), snapshot_id, self.tier,
                            self.pod_namespace, self.pod_name, self.pod_uid, time.time(), kind=self.kind,
                            engine_cache=str(self.engine_cache or ""), handover=handover,
                            include=self.ref.include, exclude=self.ref.exclude)

    def matches(self, record: VolumeRecord) -> bool:
        """Whether `record` is this very volume (a kubelet retry), not another use of the id."""
        if record.adopted:  # rebuilt from the mount table after a restart: only the target is known
            return record.target_path == self.target_path
        return (record.target_path, record.model, record.tier, record.pod_namespace, record.pod_name,
                record.pod_uid, record.engine_cache, record.kind) == (
                    self.target_path, str(self.ref), self.tier, self.pod_namespace, self.pod_name, self.pod_uid,
                    str(self.engine_cache or ""), self.kind)


def require_id(value: str, field: str) -> str:
    if not value:
        raise InvalidRequestError(field, "is required")
    if len(value.encode()) > MAX_ID_BYTES or "\0" in value:
        raise InvalidRequestError(field, f"must be at most {MAX_ID_BYTES} bytes without NUL")
    return value


def require_path(value: str, field: str) -> str:
    """Present, absolute, without NUL; not normalised: a `..` must be seen (and refused), not resolved."""
    if not value:
        raise InvalidRequestError(field, "is required")
    if "\0" in value or not os.path.isabs(value):
        raise InvalidRequestError(field, f"must be an absolute path, got {value!r}")
    return value


def parse_timeout(text: str) -> float | None:
    """volume_context.timeout: at most how long one publish waits for a download (a cached model never waits)."""
    if not text:
        return None
    match = _DURATION.match(text.strip())
    seconds = float(match[1]) * _UNIT[match[2]] if match else -1.0
    if not 0 < seconds <= MAX_TIMEOUT_S:
        raise InvalidRequestError("volume_context.timeout",
                                  f"{text!r} is not a duration more than 0 and at most {MAX_TIMEOUT_S:.0f}s; write "
                                  "e.g. \"30s\", or leave it out to wait as long as kubelet does")
    return seconds


def parse_publish(request: csi_pb2.NodePublishVolumeRequest) -> PublishArgs:
    """Validate a NodePublishVolume request, field by field in the spec's order (pure: no I/O)."""
    volume_id = require_id(request.volume_id, "volume_id")
    target = require_path(request.target_path, "target_path")
    _check_capability(request)
    ctx = request.volume_context
    engine = _engine_cache(ctx.get(ENGINE_CACHE_ATTRIBUTE, ""))
    report = _flag(ctx, REPORT_ATTRIBUTE)
    if not request.readonly and engine is None and not report:  # only a pod's private scratch is ever writable
        raise InvalidRequestError("readonly", "weightcache volumes are read-only; set `readOnly: true` on the "
                                  f"pod's csi volume (only a volume with {ENGINE_CACHE_ATTRIBUTE} or "
                                  f"{REPORT_ATTRIBUTE} may be writable)")
    ref = _model(ctx)
    tier = ctx.get("tier") or "disk"
    if tier not in TIERS:
        raise InvalidRequestError("volume_context.tier", f"{tier!r} is not one of {', '.join(TIERS)}")
    hf_repo = _hf_repo(ctx, engine)
    stream = _stream(ctx, engine, hf_repo, tier)
    adapters = _adapters(ctx, engine, hf_repo, stream, tier)
    if report and (clash := next((name for name, on in (("engineCache", engine is not None), ("hfRepo", hf_repo),
                                                        (STREAM_ATTRIBUTE, stream), (ADAPTERS_ATTRIBUTE, adapters),
                                                        ("tier: memory", tier == "memory")) if on), None)):
        raise InvalidRequestError(f"volume_context.{REPORT_ATTRIBUTE}", f"cannot be \"true\" with {clash}: a report "
                                  "volume holds what the pod's engine says about its start, not the model; use two "
                                  "volumes (an engine-cache volume carries the report itself)")
    namespace = ctx.get(POD_NAMESPACE, "")
    if not namespace:
        raise InvalidRequestError(f"volume_context.{POD_NAMESPACE}", "is missing; the CSIDriver "
                                  "csi.weightcache.io must have podInfoOnMount: true")
    return PublishArgs(volume_id, target, ref, tier, parse_timeout(ctx.get("timeout", "")), namespace,
                       ctx.get(POD_NAME, ""), ctx.get(POD_UID, ""), hf_repo, engine, bool(request.readonly), stream,
                       adapters, report)


def _check_capability(request: csi_pb2.NodePublishVolumeRequest) -> None:
    if not request.HasField("volume_capability"):
        raise InvalidRequestError("volume_capability", "is required")
    capability = request.volume_capability
    if capability.HasField("block"):
        raise InvalidRequestError("volume_capability.block", "weightcache volumes are directories; use a "
                                  "filesystem (mount) volume")
    if capability.access_mode.mode == csi_pb2.VolumeCapability.AccessMode.UNKNOWN:
        raise InvalidRequestError("volume_capability.access_mode", "is required")


def _model(ctx: Mapping[str, str]) -> ModelRef:
    globs = {}
    for field in ("include", "exclude"):  # docs/csi.md: a JSON list or comma-separated globs
        try:
            globs[field] = parse_globs(ctx.get(field, ""), field)
        except InvalidReferenceError as exc:
            raise InvalidRequestError(f"volume_context.{field}", str(exc)) from None
    try:
        return parse_ref(ctx.get("model", ""), revision=ctx.get("revision") or None, include=globs["include"],
                         exclude=globs["exclude"])
    except InvalidReferenceError as exc:  # its message is already redacted (uri._fail)
        raise InvalidRequestError("volume_context.model",
                                  f"{exc} (set it in the volume's volumeAttributes)") from None


def _hf_repo(ctx: Mapping[str, str], engine: EngineName | None) -> str | None:
    hf_repo = ctx.get("hfRepo") or None
    if hf_repo is None:
        return None
    try:
        validate_repo_id(hf_repo)
    except InvalidReferenceError as exc:
        raise InvalidRequestError("volume_context.hfRepo", str(exc)) from None
    if engine is not None:
        raise InvalidRequestError("volume_context.hfRepo", f"is for a model volume; a volume with "
                                  f"{ENGINE_CACHE_ATTRIBUTE} holds an engine's compile cache, not the model")
    return hf_repo


def _stream(ctx: Mapping[str, str], engine: EngineName | None, hf_repo: str | None, tier: str) -> bool:
    stream = _flag(ctx, STREAM_ATTRIBUTE)
    if stream:  # docs/streaming-pods.md: a plain tree of verified files, nothing built from the whole
        clash = ("engineCache" if engine is not None else "hfRepo" if hf_repo is not None else
                 "tier: memory" if tier == "memory" else None)
        if clash is not None:
            raise InvalidRequestError(f"volume_context.{STREAM_ATTRIBUTE}", f"cannot be \"true\" with {clash}: "
                                      "a streaming view holds the model's files as they arrive; remove one of the two")
    return stream


def _flag(ctx: Mapping[str, str], name: str) -> bool:
    value = ctx.get(name, "") or "false"
    if value not in ("true", "false"):
        raise InvalidRequestError(f"volume_context.{name}", f"{value!r} is not \"true\" or \"false\"")
    return value == "true"


def _adapters(ctx: Mapping[str, str], engine: EngineName | None, hf_repo: str | None, stream: bool,
              tier: str) -> bool:
    adapters = _flag(ctx, ADAPTERS_ATTRIBUTE)
    if adapters:  # docs/adapters.md: a directory of the model's adapters, not the model
        clash = ("engineCache" if engine is not None else "hfRepo" if hf_repo is not None else
                 STREAM_ATTRIBUTE if stream else "tier: memory" if tier == "memory" else None)
        if clash is not None:
            raise InvalidRequestError(f"volume_context.{ADAPTERS_ATTRIBUTE}", f"cannot be \"true\" with {clash}: "
                                      "an adapter directory holds the LoRA adapters of its model; use two volumes")
    return adapters


def _engine_cache(text: str) -> EngineName | None:
    """volume_context.engineCache: `vllm-0.32.0-cpu` (docs/engine-caches.md), or None for a model volume."""
    if not text:
        return None
    try:
        return EngineName.parse(text)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"volume_context.{ENGINE_CACHE_ATTRIBUTE}",
                                  f"{str(exc).removeprefix('engine cache: ')} (set it in the volume's "
                                  "volumeAttributes, or remove it for a model volume)") from None
