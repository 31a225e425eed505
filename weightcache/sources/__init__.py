"""Sources: list a model's objects and read pinned byte ranges, whatever stores them.

`open_source(ref)` picks a backend by the reference's scheme. Backends are imported only when used, so a node
without gcsfs still serves s3:// models, and asking for gs:// there says what to install.

    scheme              backend                        extra package
    s3                  sources.s3.S3Source            (boto3, always installed)
    http, https         sources.http.HttpSource        (urllib3: HTML index listing, ranges)
    file, memory        sources.fsspec.FsspecSource    -
    gs                  sources.fsspec.FsspecSource    gcsfs
    az                  sources.fsspec.FsspecSource    adlfs
    hf                  sources.hf.HfSource            huggingface_hub (hf://org/name[@revision])
    oci                 sources.oci.OciSource          (urllib3: oci://registry/repository:tag or @sha256:...)
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
from collections.abc import Callable
from typing import Any

from weightcache.errors import BackendMissingError, InvalidReferenceError
from weightcache.sources.base import ClientPool, ObjectInfo, Source, SourceOptions
from weightcache.uri import ModelRef

__all__ = ["BACKENDS", "ClientPool", "ObjectInfo", "Source", "SourceOptions", "open_source"]

#: scheme -> ("module:Class", the package it needs beyond our own dependencies or None)
BACKENDS: dict[str, tuple[str, str | None]] = {
    "s3": ("weightcache.sources.s3:S3Source", None),
    "http": ("weightcache.sources.http:HttpSource", None),
    "https": ("weightcache.sources.http:HttpSource", None),
    "file": ("weightcache.sources.fsspec:FsspecSource", None),
    "memory": ("weightcache.sources.fsspec:FsspecSource", None),
    "gs": ("weightcache.sources.fsspec:FsspecSource", "gcsfs"),
    "az": ("weightcache.sources.fsspec:FsspecSource", "adlfs"),
    "hf": ("weightcache.sources.hf:HfSource", "huggingface_hub"),
    "oci": ("weightcache.sources.oci:OciSource", None),
}


def open_source(ref: ModelRef, options: SourceOptions | None = None, **changes: Any) -> Source:
    """A source for `ref` under `options` (defaults: SourceOptions()), with `changes` applied to them
    (e.g. `open_source(ref, endpoint_url=url, backoff=0.01)`)."""
    try:
        target, package = BACKENDS[ref.scheme]
    except KeyError:
        raise InvalidReferenceError(
            f"no source for scheme {ref.scheme!r} of {ref.uri}; use one of: {', '.join(BACKENDS)}"
        ) from None
    if package and importlib.util.find_spec(package) is None:
        raise BackendMissingError(
            f"reading {ref.scheme}:// models needs the {package} package: pip install {package}", name=package
        )
    module, _, cls = target.partition(":")
    backend: Callable[[ModelRef, SourceOptions], Source] = getattr(importlib.import_module(module), cls)
    return backend(ref, dataclasses.replace(options or SourceOptions(), **changes))
