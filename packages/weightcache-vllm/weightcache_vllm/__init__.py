"""vLLM plugin: the load format `weightcache` (`vllm serve /models/model --load-format weightcache`).

vLLM finds `register` through the entry point `weightcache` in group `vllm.general_plugins` and calls it in every
process it starts (the API server, the engine core, each worker), so it must be cheap and idempotent. It imports
vLLM only when called: importing this package needs neither vLLM nor torch. Nor does `register` import vLLM's
loader package (`vllm.model_executor.model_loader`, whose imports pull in the attention and kernel modules): where
that package is not imported yet, the loader is registered the moment it is. The API server's (or `LLM`'s)
process never imports it (load formats are not checked there); importing it there only for us put 2 s on the
engine-up path on top of that process's own imports, at load 20 on 2 cores (11.7 s in a cProfile of a
single-process engine, where it was the first to import vLLM's attention and kernel modules).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

from weightcache_vllm.options import LOAD_FORMAT, Options, parse_options, weights_wanted

__all__ = ["LOAD_FORMAT", "Options", "parse_options", "register", "weights_wanted"]

LOADERS_PACKAGE = "vllm.model_executor.model_loader"  # where vLLM's get_model_loader looks load formats up
_lock = threading.Lock()
_registered = False
_hooked = False


def register() -> None:
    """Register the `weightcache` model loader with vLLM, now if vLLM's loader package is imported, else as soon
    as it is (once per process; later calls do nothing)."""
    global _hooked
    with _lock:
        if _registered:
            return
        if LOADERS_PACKAGE not in sys.modules:
            if not _hooked:
                sys.meta_path.insert(0, _RegisterOnImport())
                _hooked = True
            return
    _register_now()  # imported already (or by a way around the hook): now


def _register_now() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from weightcache_vllm.vllm_loader import register_loader

        register_loader()
        _registered = True


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Finds vLLM's loader package through the other finders, once, and registers our loader right after the
    package's own code ran (before any `import` of it returns)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != LOADERS_PACKAGE:
            return None
        sys.meta_path.remove(self)  # one shot: the lookup below must not come back here
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        run = spec.loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            _register_now()

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]  # this spec's own loader instance
        return spec
