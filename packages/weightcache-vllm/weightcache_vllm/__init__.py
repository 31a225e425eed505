"""vLLM plugin: the load format `weightcache` (`vllm serve /models/model --load-format weightcache`).

vLLM finds `register` through the entry point `weightcache` in group `vllm.general_plugins` and calls it in every
process it starts (the API server, the engine core, each worker), so it must be cheap and idempotent. It imports
vLLM only when called: importing this package needs neither vLLM nor torch.
"""

from __future__ import annotations

import threading

from weightcache_vllm.options import LOAD_FORMAT, Options, parse_options, weights_wanted

__all__ = ["LOAD_FORMAT", "Options", "parse_options", "register", "weights_wanted"]

_lock = threading.Lock()
_registered = False


def register() -> None:
    """Register the `weightcache` model loader with vLLM (once per process; later calls do nothing)."""
    global _registered
    with _lock:
        if _registered:
            return
        from weightcache_vllm.vllm_loader import register_loader

        register_loader()
        _registered = True
