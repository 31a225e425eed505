"""Pod annotations -> what to inject: parsed once, validated without I/O, carried as frozen values.

    weightcache.io/model: s3://models/llama-3-8b/@rev        one model at /models/model, env WEIGHTCACHE_MODEL_PATH
    weightcache.io/models: "llama=s3://m/llama/,draft=s3://m/draft/"
                                                             each at /models/<name>, env WEIGHTCACHE_MODEL_PATH_<NAME>
    weightcache.io/mount-path: /weights                      one model: its mount path; several: the base directory
    weightcache.io/containers: "server,warmup"               default: every app container (no init containers)
    weightcache.io/tier: disk | memory                       default: disk
    weightcache.io/placement: require | prefer | gate        default require (docs/placement.md)
    weightcache.io/require-cached: "true" | "false"          older spelling of placement: require | prefer
    weightcache.io/include: "*.safetensors,*.json"           only these files of every model (or a JSON list);
    weightcache.io/exclude: "*.bin"                          must stay within what the ModelCache grants
    weightcache.io/hf-repo: org/name                         one model: mounted as a hub cache for that repo,
                                                             env HF_HUB_CACHE (the mount) and HF_HUB_OFFLINE=1
    weightcache.io/engine-cache: vllm-0.32.0-cpu             one model: the engine's compile cache for it, a
                                                             writable CSI volume at /var/cache/weightcache-engine,
                                                             env WEIGHTCACHE_ENGINE_CACHE (and VLLM_CACHE_ROOT for
                                                             vllm); docs/engine-caches.md
    weightcache.io/stream: "true" | "false"                  default false: the volumes show each file as it is
                                                             fetched (volume attribute stream); placement prefer,
                                                             no gate; not with hf-repo, tier memory or via: dra
                                                             (docs/streaming-pods.md)
    weightcache.io/adapters: "true" | "false"                one model: its LoRA adapter directory, a read-only CSI
                                                             volume at /models/adapters that the node fills while the
                                                             pod runs, env WEIGHTCACHE_ADAPTERS_PATH (docs/adapters.md)

Every error message shows a line the user can paste instead.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

from weightcache.engine_name import EngineName
from weightcache.errors import AnnotationError, InvalidReferenceError, InvalidRequestError
from weightcache.uri import ModelRef, parse_globs, parse_ref, readiness_label, validate_repo_id
from weightcache.vocabulary import (
    ADAPTERS_PATH_ENV,
    ANNOTATION_PREFIX,
    MODEL_ANNOTATION,
    REPORT_DIR_ENV,
    STREAM_ANNOTATION,
)

PREFIX = ANNOTATION_PREFIX
MODEL = MODEL_ANNOTATION
MODELS = PREFIX + "models"
MOUNT_PATH = PREFIX + "mount-path"
CONTAINERS = PREFIX + "containers"
TIER = PREFIX + "tier"
REQUIRE_CACHED = PREFIX + "require-cached"
INCLUDE = PREFIX + "include"
EXCLUDE = PREFIX + "exclude"
PLACEMENT = PREFIX + "placement"
HF_REPO = PREFIX + "hf-repo"
ENGINE_CACHE = PREFIX + "engine-cache"
STREAM = STREAM_ANNOTATION  # weightcache.io/stream: the CSI plugin reads the volume attribute the webhook writes
ADAPTERS = PREFIX + "adapters"
TELEMETRY = PREFIX + "telemetry"
KNOWN = (MODEL, MODELS, MOUNT_PATH, CONTAINERS, TIER, REQUIRE_CACHED, INCLUDE, EXCLUDE, PLACEMENT, HF_REPO,
         ENGINE_CACHE, STREAM, ADAPTERS, TELEMETRY)
PLACEMENTS = ("require", "prefer", "gate")

TIERS = ("disk", "memory")
ENV_SINGLE = "WEIGHTCACHE_MODEL_PATH"
ENV_ENGINE_CACHE = "WEIGHTCACHE_ENGINE_CACHE"
# an engine's own variables for its compile caches, each at a path under the volume ("": its root). vLLM's CPU
# build compiles with inductor alone, whose FX-graph cache is under TORCHINDUCTOR_CACHE_DIR (/tmp by default): not
# in the volume, every pod compiled again (docs/engine-caches.md); on GPU vLLM points inductor at its own cache dir
ENGINE_ENV = {"vllm": (("VLLM_CACHE_ROOT", ""), ("TORCHINDUCTOR_CACHE_DIR", "inductor"))}
VOLUME_PREFIX = "wc-"
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_MAX_NAME = 63 - len(VOLUME_PREFIX)  # the volume name wc-<name> must stay a DNS label
_PATH = re.compile(r"^(/[A-Za-z0-9._\-]+)+/?$")
_EXAMPLE_MODELS = f'{MODELS}: "llama=s3://models/llama-3-8b/,draft=s3://models/llama-draft/"'
# Bounds of one review, checked before anything is parsed: the API server calls mutating webhooks before it
# validates the pod (its own 256 KiB annotation limit comes later), so an annotation of any size reaches us, and a
# review costs O(models): a 301 KB annotation of thousands of models took seconds. A model is a volume, a mount
# and an env var in every chosen container: no real pod mounts dozens.
MAX_MODELS = 16  # models per pod; `weightcache webhook --max-models` changes it
MAX_ANNOTATION_CHARS = 32 * 1024  # the weightcache.io/* annotations together (16 long references fit many times)


@dataclass(frozen=True)
class ModelMount:
    """One model to inject: its volume, where it is mounted and the env var that points there."""

    name: str
    ref: ModelRef
    volume: str
    mount_path: str
    env: str
    label: str  # node label key the daemon sets to "ready" where the model is cached
    hf_repo: str | None = None  # mounted as a hub cache for this repo (weightcache.hf_layout)


@dataclass(frozen=True)
class EngineCacheMount:
    """The engine's compile cache for the pod's one model: a writable CSI volume (a private, bounded scratch the
    plugin fills from the node's cache for the key, or leaves empty and reads back when the pod ends)."""

    name: EngineName
    model: ModelMount
    volume: str = VOLUME_PREFIX + "engine-cache"
    mount_path: str = "/var/cache/weightcache-engine"

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        """WEIGHTCACHE_ENGINE_CACHE for any engine (a startup probe writes the ready file there); the engine's own
        cache root variable where we know it."""
        own = ENGINE_ENV.get(self.name.engine, ())
        return ((ENV_ENGINE_CACHE, self.mount_path),
                *((var, f"{self.mount_path}/{sub}" if sub else self.mount_path) for var, sub in own))


@dataclass(frozen=True)
class AdaptersMount:
    """The LoRA adapter directory of the pod's one model: a read-only CSI volume the node fills while the pod
    runs with the adapters its namespace may have (docs/adapters.md)."""

    model: ModelMount
    volume: str = VOLUME_PREFIX + "adapters"
    mount_path: str = "/models/adapters"

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        return ((ADAPTERS_PATH_ENV, self.mount_path),)  # the vLLM plugin's LoRA resolver reads it


@dataclass(frozen=True)
class ReportMount:
    """Where the pod's engine reports its start when it has no engine-cache volume (docs/telemetry.md): a small
    writable CSI volume naming the pod's first model, so only pods that may mount that model get one."""

    model: ModelMount
    volume: str = VOLUME_PREFIX + "report"
    mount_path: str = "/var/run/weightcache-report"

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        return ((REPORT_DIR_ENV, self.mount_path),)  # the vLLM plugin writes its report there


@dataclass(frozen=True)
class Injection:
    """Everything the annotations ask for."""

    models: tuple[ModelMount, ...]
    containers: tuple[str, ...] | None  # None: every app container
    tier: str
    placement: str | None  # require | prefer | gate; None: not asked (the webhook picks, docs/placement.md);
    #   prefer for a streaming pod (it starts while its model downloads: nothing to gate or require it for)
    engine_cache: EngineCacheMount | None = None
    stream: bool = False  # the model volumes show each file as it is fetched (docs/streaming-pods.md)
    adapters: AdaptersMount | None = None
    report: ReportMount | None = None  # weightcache.io/telemetry without an engine cache, whose volume reports


def wants_injection(annotations: Mapping[str, object]) -> bool:
    return MODEL in annotations or MODELS in annotations


def parse_annotations(annotations: Mapping[str, object], *, max_models: int = MAX_MODELS) -> Injection:
    """Parse the `weightcache.io/*` annotations of a pod that `wants_injection`; raise AnnotationError (also
    for more than `max_models` models or MAX_ANNOTATION_CHARS of annotations: both checked before any parsing)."""
    for key in KNOWN:
        if key in annotations and not isinstance(annotations[key], str):
            raise AnnotationError(f'annotation {key} must be a string; quote it in YAML, as in {key}: "..."')
    items = tuple((k, str(annotations[k]).strip()) for k in KNOWN if k in annotations)
    size = sum(len(v) for _, v in items)
    if size > MAX_ANNOTATION_CHARS:
        raise AnnotationError(f"the {PREFIX}* annotations hold {size} characters, more than the {MAX_ANNOTATION_CHARS} "
                              f"a pod may use; name at most {max_models} models, each once, as in {_EXAMPLE_MODELS}")
    return _parse(items, max_models)


@functools.lru_cache(maxsize=1024)  # at most MAX_ANNOTATION_CHARS each: a bounded cache whatever is sent
def _parse(items: tuple[tuple[str, str], ...], max_models: int) -> Injection:
    """Cached: every pod of a Deployment carries the same annotations, and the result is a frozen value."""
    values = dict(items)
    if MODEL in values and MODELS in values:
        raise AnnotationError(
            f"use either {MODEL} (one model) or {MODELS} (several), not both; for several write {_EXAMPLE_MODELS}"
        )
    globs = (_globs(INCLUDE, values.get(INCLUDE)), _globs(EXCLUDE, values.get(EXCLUDE)))
    named = (_parse_models(values[MODELS], globs, max_models) if MODELS in values
             else [("model", _ref(MODEL, values[MODEL], globs))])
    single = MODELS not in values
    base = _mount_path(values.get(MOUNT_PATH))
    models = tuple(
        ModelMount(
            name=name,
            ref=ref,
            volume=VOLUME_PREFIX + name,
            mount_path=(base or "/models/model") if single else f"{base or '/models'}/{name}",
            env=ENV_SINGLE if single else f"{ENV_SINGLE}_{name.upper().replace('-', '_')}",
            label=readiness_label(ref),
            hf_repo=_hf_repo(values.get(HF_REPO), single),
        )
        for name, ref in named
    )
    stream = _stream(values)
    tier = _tier(values.get(TIER))
    placement = _placement(values.get(PLACEMENT), values.get(REQUIRE_CACHED))
    return Injection(
        models=models,
        containers=_containers(values.get(CONTAINERS)),
        tier=tier,
        placement="prefer" if stream else placement,
        engine_cache=_engine_cache(values.get(ENGINE_CACHE), models),
        stream=stream,
        adapters=_adapters(values.get(ADAPTERS), models, single),
        report=ReportMount(models[0]) if ENGINE_CACHE not in values and TELEMETRY in values
        and _boolean(TELEMETRY, values[TELEMETRY]) else None,
    )


def _adapters(text: str | None, models: tuple[ModelMount, ...], single: bool) -> AdaptersMount | None:
    if text is None or not _boolean(ADAPTERS, text):
        return None
    if not single:
        raise AnnotationError(f'{ADAPTERS}: "true" is for a pod of one model ({MODEL}): the directory holds the '
                              f"adapters of that base model; write {MODEL}: <base model> or remove {ADAPTERS}")
    return AdaptersMount(models[0])


def _stream(values: Mapping[str, str]) -> bool:
    """weightcache.io/stream, and what a volume that grows while the model downloads cannot go with: the gate or
    a required affinity (the wait streaming avoids), a hub cache layout and the memory tier (both need the whole
    snapshot). Named by the key and value the pod wrote, so the message says what to remove."""
    if STREAM not in values or not _boolean(STREAM, values[STREAM]):
        return False
    off = f'or write {STREAM}: "false" to wait for the whole model'
    asked = ([(PLACEMENT, values[PLACEMENT], f"{PLACEMENT}: prefer")] if values.get(PLACEMENT) in ("gate", "require")
             else []) + ([(REQUIRE_CACHED, f'"{values[REQUIRE_CACHED]}"', f'{REQUIRE_CACHED}: "false"')]
                         if values.get(REQUIRE_CACHED, "").lower() == "true" else [])
    if asked:
        key, shown, instead = asked[0]
        raise AnnotationError(
            f'{STREAM}: "true" cannot go with {key}: {shown}: a streaming pod starts while its model downloads, so '
            f"it is neither gated nor required onto nodes that hold the model (it prefers them); write {instead} "
            f"(or remove {key}), {off}")
    if HF_REPO in values:
        raise AnnotationError(
            f'{STREAM}: "true" cannot go with {HF_REPO}: a hub cache layout is built from a whole snapshot; '
            f"remove {HF_REPO} and load the model by path ({ENV_SINGLE}), {off}")
    if values.get(TIER) == "memory":
        raise AnnotationError(
            f'{STREAM}: "true" cannot go with {TIER}: memory: the memory tier locks a whole snapshot in RAM; '
            f"write {TIER}: disk, {off}")
    return True


def _engine_cache(text: str | None, models: tuple[ModelMount, ...]) -> EngineCacheMount | None:
    if text is None:
        return None
    if len(models) != 1 or models[0].name != "model":
        raise AnnotationError(f"{ENGINE_CACHE} applies to one model ({MODEL}): the cache is kept per model snapshot")
    try:
        return EngineCacheMount(EngineName.parse(text), models[0])
    except InvalidRequestError as exc:
        raise AnnotationError(f"{ENGINE_CACHE}: {str(exc).removeprefix('engine cache: ')}; write "
                              f"{ENGINE_CACHE}: vllm-0.32.0-cpu (engine, its version, the device kind)") from None


def _hf_repo(text: str | None, single: bool) -> str | None:
    if text is None:
        return None
    if not single:
        raise AnnotationError(f"{HF_REPO} applies to one model ({MODEL}); with {MODELS} mount each model's "
                              f"directory and load it by path")
    try:
        return validate_repo_id(text)
    except InvalidReferenceError as exc:
        raise AnnotationError(f"{exc}; write e.g. {HF_REPO}: meta-llama/Llama-3.1-8B") from None


def _ref(key: str, text: str, globs: tuple[tuple[str, ...], tuple[str, ...]], name: str | None = None) -> ModelRef:
    try:
        return parse_ref(text, include=globs[0], exclude=globs[1])
    except InvalidReferenceError as exc:  # its message is already redacted (uri._fail)
        where = f"{key} entry {name!r}" if name else key
        raise AnnotationError(f"{where}: {exc}") from None


def _globs(key: str, text: str | None) -> tuple[str, ...]:
    try:
        return parse_globs(text or "", key)
    except InvalidReferenceError as exc:
        raise AnnotationError(f'{exc}; as in {key}: "*.safetensors,*.json"') from None


def _parse_models(text: str, globs: tuple[tuple[str, ...], tuple[str, ...]],
                  max_models: int) -> list[tuple[str, ModelRef]]:
    entries = [e.strip() for e in text.split(",") if e.strip()]
    if not entries:
        raise AnnotationError(f"{MODELS} is empty; write {_EXAMPLE_MODELS}")
    if len(entries) > max_models:  # before any is parsed: the cost of a refusal must not grow with the list
        raise AnnotationError(f"{MODELS} names {len(entries)} models; a pod may mount at most {max_models} (the "
                              f"webhook's --max-models): split the workload into pods that need fewer models")
    seen: set[str] = set()
    out: list[tuple[str, ModelRef]] = []
    for entry in entries:
        name, sep, ref_text = (p.strip() for p in entry.partition("="))
        if not sep:
            raise AnnotationError(f"{MODELS} entry {entry!r} has no name; write <name>=<ref>, as in {_EXAMPLE_MODELS}")
        if len(name) > _MAX_NAME or not _DNS_LABEL.match(name):
            raise AnnotationError(
                f"{MODELS} name {name!r} must be a DNS label of at most {_MAX_NAME} characters (lowercase letters, "
                f"digits, '-', starting and ending alphanumeric), as in {_EXAMPLE_MODELS}"
            )
        if name in seen:
            raise AnnotationError(
                f"{MODELS} names {name!r} twice; give each model its own name, as in {_EXAMPLE_MODELS}"
            )
        seen.add(name)
        out.append((name, _ref(MODELS, ref_text, globs, name)))
    return out


def _mount_path(text: str | None) -> str | None:
    if text is None:
        return None
    if not _PATH.match(text) or any(part in (".", "..") for part in text.split("/")):
        raise AnnotationError(
            f"{MOUNT_PATH} {text!r} must be an absolute path of letters, digits, '.', '_', '-' without '..', "
            f"as in {MOUNT_PATH}: /models/llama"
        )
    return text.rstrip("/")


def _containers(text: str | None) -> tuple[str, ...] | None:
    if text is None:
        return None
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or len(set(names)) != len(names) or not all(_DNS_LABEL.match(n) for n in names):
        raise AnnotationError(
            f"{CONTAINERS} {text!r} must be a comma-separated list of distinct container names, "
            f'as in {CONTAINERS}: "server,warmup" (or remove it to use every app container)'
        )
    return names


def _tier(text: str | None) -> str:
    if text is None:
        return "disk"
    if text not in TIERS:
        raise AnnotationError(f"{TIER} {text!r} is not a tier; write {TIER}: disk (or {TIER}: memory)")
    return text


def _placement(text: str | None, require_cached: str | None) -> str | None:
    old = None if require_cached is None else ("require" if _boolean(REQUIRE_CACHED, require_cached) else "prefer")
    if text is None:
        return old
    if text not in PLACEMENTS:
        raise AnnotationError(f"{PLACEMENT} {text!r} is not one of {', '.join(PLACEMENTS)}; write {PLACEMENT}: require")
    if old is not None and old != text:
        raise AnnotationError(f"{REQUIRE_CACHED} says {old} but {PLACEMENT} says {text}; remove {REQUIRE_CACHED}")
    return text


def _boolean(key: str, text: str) -> bool:
    if text.lower() not in ("true", "false"):
        raise AnnotationError(f'{key} {text!r} must be "true" or "false"; write {key}: "true"')
    return text.lower() == "true"
