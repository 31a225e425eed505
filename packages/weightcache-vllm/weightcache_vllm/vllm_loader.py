"""The `weightcache` model loader, on vLLM's public loader interface (vllm.model_executor.model_loader).

Imported only by `register()` inside a vLLM process. vLLM builds the model (on the device, sharded for its
tensor-parallel rank and its pipeline stage), then calls `load_weights(model, model_config)`; this loader hands the
model's own `model.load_weights` an iterable of (checkpoint name, tensor) where each tensor is a zero-copy,
copy-on-write CPU view of the mounted file (weightcache.loader), so the bytes move once: from the node's page cache
(or the memory tier's locked pages) into the model's parameters. `model.load_weights` renames, stacks (q/k/v into
qkv_proj) and narrows each tensor to this rank's slice itself, exactly as with vLLM's default loader.

A streaming view (docs/streaming-pods.md: the directory holds `.weightcache/state` and grows while the node
fetches) is loaded through `iter_tensors_streaming`: each shard's tensors go to `model.load_weights` as soon as that
shard is in the view. Whether it is a safetensors model is decided from the state's planned files (waiting for
that list), and which tensors to read by testing each name as it comes, since the names are not known before the
shards are there. vLLM reads config.json and the tokenizer before this loader runs: the pod's entry point must wait
for them (`weightcache.loader.wait_for_files`, docs/loader.md).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from vllm.logger import init_logger
from vllm.model_executor.model_loader import (  # the public names of vLLM's loader package
    BaseModelLoader,
    DefaultModelLoader,
    register_model_loader,
)

from weightcache.loader import (
    INDEX_NAME,
    MAX_INDEX_BYTES,
    iter_tensors,
    iter_tensors_streaming,
    planned_files,
    wait_for_files,
)
from weightcache.safetensors_check import parse_header
from weightcache.vocabulary import STREAM_STATE
from weightcache_vllm import telemetry
from weightcache_vllm.options import LOAD_FORMAT, Options, parse_options, weights_wanted

# under "vllm.": vLLM's handler and format, in every process (a logger outside that tree prints nothing)
log = init_logger("vllm.plugins.weightcache_vllm")
REPORT_ENV = "WEIGHTCACHE_VLLM_REPORT"  # a file each load appends one JSON line to (tests; operators' checks)
MODEL_PATH_ENV = "WEIGHTCACHE_MODEL_PATH"  # set by the webhook to the mounted snapshot


def snapshot_dir(model: str, options: Options) -> Path | None:
    """Where to read weights: the extra config's `path`, else the model directory vLLM was given, else
    $WEIGHTCACHE_MODEL_PATH (e.g. `vllm serve org/name` from a mounted hub cache); None when none of these is a
    directory holding a safetensors model (then the default loader takes over)."""
    for candidate in (options.path, model, os.environ.get(MODEL_PATH_ENV)):
        if candidate and _is_safetensors_model(Path(candidate), options.stream_timeout):
            return Path(candidate)
    return None


def _is_safetensors_model(p: Path, stream_timeout: float = 600.0) -> bool:
    """A directory with an index or root *.safetensors; for a streaming view, one whose state plans them (the
    shards may not be there yet: waits for the planned list, and raises the loader's error if the view failed or
    stalled: a fallback to vLLM's default loader would read a half-filled directory)."""
    try:
        if not p.is_dir():
            return False
        if not _streaming(p):
            return (p / INDEX_NAME).is_file() or any(p.glob("*.safetensors"))
    except OSError:
        return False
    planned = planned_files(p, timeout=stream_timeout) or []
    return any(r == INDEX_NAME or ("/" not in r and r.endswith(".safetensors")) for r in planned)


def _streaming(p: Path) -> bool:
    """A view the daemon still fills (or filled): `iter_tensors_streaming` reads it (a plain snapshot has no state)."""
    return os.path.lexists(p / STREAM_STATE)


def _names(directory: Path) -> list[str]:
    """Every tensor name of the model: the index's weight_map, else each file's header (the loader checks both
    again, fully, when it maps the files)."""
    index = directory / INDEX_NAME
    if index.is_file():
        try:
            with open(index, "rb") as fh:
                weight_map = json.loads(fh.read(MAX_INDEX_BYTES + 1)).get("weight_map")
        except (ValueError, AttributeError, RecursionError):
            weight_map = None
        # not an index the loader accepts: iter_tensors raises ModelLayoutError saying why
        return list(weight_map) if isinstance(weight_map, dict) else []
    names: list[str] = []
    for file in sorted(directory.glob("*.safetensors")):
        with open(file, "rb") as fh:
            names += parse_header(fh, os.fstat(fh.fileno()).st_size).tensors
    return names


def _layer_range(model_config: Any) -> tuple[int, int] | None:
    """This pipeline stage's decoder layers [start, end), or None without pipeline parallelism."""
    try:
        from vllm.distributed import get_pp_group
        from vllm.distributed.utils import get_pp_indices

        group = get_pp_group()
        if group.world_size <= 1:
            return None
        layers = model_config.hf_text_config.num_hidden_layers
        return get_pp_indices(layers, group.rank_in_group, group.world_size)
    except Exception:  # no distributed state (a bare test) or a model without the usual fields: read everything
        return None


def _report(record: dict[str, Any]) -> None:
    path = os.environ.get(REPORT_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(record) + "\n")


class WeightcacheModelLoader(BaseModelLoader):
    """`--load-format weightcache`; options in `--model-loader-extra-config` (weightcache_vllm.options)."""

    def __init__(self, load_config: Any) -> None:
        super().__init__(load_config)
        self.options = parse_options(load_config.model_loader_extra_config)
        self._fallback: BaseModelLoader | None = None

    def _default(self) -> BaseModelLoader:
        if self._fallback is None:
            self._fallback = DefaultModelLoader(dataclasses.replace(
                self.load_config, load_format="auto", model_loader_extra_config={}))
        return self._fallback

    def _directory(self, model_config: Any) -> Path | None:
        directory = snapshot_dir(model_config.model, self.options)
        if directory is None:
            if self.options.require:
                raise ValueError(f"load format {LOAD_FORMAT!r} with require=true: {model_config.model!r} is not a "
                                 f"directory holding a safetensors model (nor is ${MODEL_PATH_ENV}); mount the "
                                 f"model with weightcache or drop 'require'")
            log.warning("weightcache: %s holds no safetensors model; falling back to vLLM's default loader",
                        model_config.model)
            model_dir = Path(str(model_config.model))
            if model_dir.is_dir() and _streaming(model_dir):
                # the default loader reads whatever files are there: let the view fill first (every planned file
                # but *.safetensors, of which it plans none)
                wait_for_files(model_dir, timeout=self.options.stream_timeout)
        return directory

    def download_model(self, model_config: Any) -> None:
        if self._directory(model_config) is None:
            self._default().download_model(model_config)
        # a mounted snapshot is already local: nothing to download

    def load_weights(self, model: nn.Module, model_config: Any) -> None:
        directory = self._directory(model_config)
        if directory is None:
            _report({"pid": os.getpid(), "fallback": True, "model": str(model_config.model)})
            self._default().load_weights(model, model_config)
            telemetry.weights_loaded(_current_config())
            return
        started = time.perf_counter()
        tied = bool(getattr(model_config.hf_text_config, "tie_word_embeddings", False))
        layer_range = _layer_range(model_config)
        streaming = _streaming(directory)
        stats = {"tensors": 0, "bytes": 0}

        def wanted(name: str) -> bool:
            return bool(weights_wanted([name], exclude=self.options.exclude, tied_embeddings=tied,
                                       layer_range=layer_range))

        source: Iterator[tuple[str, torch.Tensor]]  # cpu: views of the mapping, no copy
        if streaming:  # the names come with the shards: each is tested as its shard arrives
            source = iter_tensors_streaming(directory, timeout=self.options.stream_timeout, keys=wanted)
        else:
            source = iter_tensors(directory, keys=weights_wanted(
                _names(directory), exclude=self.options.exclude, tied_embeddings=tied, layer_range=layer_range))

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for name, tensor in source:
                stats["tensors"] += 1
                stats["bytes"] += tensor.numel() * tensor.element_size()
                yield name, tensor

        loaded = model.load_weights(tensors())
        seconds = time.perf_counter() - started
        if self.options.verify and loaded is not None:
            # vLLM's own check, as its default loader runs it: every parameter came from the checkpoint (with its
            # exemptions for quantization scales); raises ValueError naming the ones that did not
            self._default().track_weights_loading(model, set(loaded), quantized=model_config.quantization is not None)
        log.info("weightcache: loaded %d tensors (%.1f MB) from %s in %.2fs", stats["tensors"], stats["bytes"] / 1e6,
                 directory, seconds)
        _report({"pid": os.getpid(), "fallback": False, "directory": str(directory), "seconds": round(seconds, 4),
                 "streaming": streaming, **stats})
        telemetry.weights_loaded(_current_config())


def _current_config() -> Any:
    """The VllmConfig vLLM loads this model under (set around model loading), for the compile key; None outside."""
    from vllm.config import get_current_vllm_config_or_none

    return get_current_vllm_config_or_none()


def register_loader() -> None:
    register_model_loader(LOAD_FORMAT)(WeightcacheModelLoader)
