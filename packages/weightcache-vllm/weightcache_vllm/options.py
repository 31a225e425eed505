"""What `--model-loader-extra-config` may say, and which checkpoint tensors a model on this rank needs.

Pure functions with no vLLM import, so they are tested without vLLM.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

LOAD_FORMAT = "weightcache"

_KNOWN = {"verify", "require", "path", "exclude", "stream_timeout"}
# the decoder stack of causal LMs as checkpoints name it; other towers (vision, audio) are never filtered
_LAYER = re.compile(r"^(?:model\.|language_model\.model\.|model\.language_model\.)?layers\.(\d+)\.")


@dataclass(frozen=True)
class Options:
    verify: bool = True  # every parameter the model holds must come from the snapshot (else an error naming them)
    require: bool = False  # a directory that is not a safetensors model is an error instead of the fallback
    path: str | None = None  # read the weights from here instead of the model directory vLLM was given
    exclude: tuple[str, ...] = ()  # fnmatch globs of tensor names never read
    stream_timeout: float = 600.0  # a streaming view (docs/streaming-pods.md): seconds without a new file -> error


def parse_options(extra: Mapping[str, Any] | None) -> Options:
    """`--model-loader-extra-config` as Options; an unknown key or a wrong type raises ValueError saying which."""
    extra = dict(extra or {})
    unknown = sorted(set(extra) - _KNOWN)
    if unknown:
        raise ValueError(f"--model-loader-extra-config: unknown key(s) {unknown} for load format {LOAD_FORMAT!r}; "
                         f"known: {sorted(_KNOWN)}")
    for key in ("verify", "require"):
        if key in extra and not isinstance(extra[key], bool):
            raise ValueError(f"--model-loader-extra-config: {key!r} must be true or false, not {extra[key]!r}")
    path = extra.get("path")
    if path is not None and (not isinstance(path, str) or not path):
        raise ValueError(f"--model-loader-extra-config: 'path' must be a directory path, not {path!r}")
    exclude = extra.get("exclude", [])
    if isinstance(exclude, str):
        exclude = [exclude]
    if not isinstance(exclude, list) or not all(isinstance(g, str) for g in exclude):
        raise ValueError(f"--model-loader-extra-config: 'exclude' must be a list of globs, not {exclude!r}")
    stream_timeout = extra.get("stream_timeout", 600.0)
    if isinstance(stream_timeout, bool) or not isinstance(stream_timeout, int | float) or not stream_timeout > 0:
        raise ValueError(f"--model-loader-extra-config: 'stream_timeout' must be a number of seconds > 0, not "
                         f"{stream_timeout!r}")
    return Options(verify=extra.get("verify", True), require=extra.get("require", False), path=path,
                   exclude=tuple(exclude), stream_timeout=float(stream_timeout))


def weights_wanted(names: Iterable[str], *, exclude: Iterable[str] = (), tied_embeddings: bool = False,
                   layer_range: tuple[int, int] | None = None) -> list[str]:
    """The checkpoint tensors worth reading on this rank, in the order given.

    Dropped: names matching an `exclude` glob; `lm_head.weight` when the embeddings are tied (the model reuses
    embed_tokens and skips it); rotary `inv_freq` buffers (computed, never loaded); decoder layers outside
    `layer_range` = [start, end) (pipeline parallelism: another rank holds them). Everything else goes to the
    model's own `load_weights`, which also narrows each tensor to this tensor-parallel rank's slice.
    """
    globs = tuple(exclude)
    out = []
    for name in names:
        if any(fnmatch.fnmatchcase(name, g) for g in globs):
            continue
        if tied_embeddings and name == "lm_head.weight":
            continue
        if name.endswith("rotary_emb.inv_freq"):
            continue
        if layer_range is not None:
            m = _LAYER.match(name)
            if m and not layer_range[0] <= int(m.group(1)) < layer_range[1]:
                continue
        out.append(name)
    return out
