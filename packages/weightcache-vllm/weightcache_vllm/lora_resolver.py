"""vLLM LoRA resolver `weightcache`: a request that names an adapter the pod may have loads it, on first use, from
the pod's adapter directory (docs/adapters.md).

The node fills that directory (a read-only CSI volume with `adapters: "true"`, mounted where
$WEIGHTCACHE_ADAPTERS_PATH says) with the adapters of the pod's base model that its namespace may have, while the
pod runs: what is there is what the pod may have. Each adapter appears whole, its `adapter_config.json` last. vLLM
asks its resolvers (vllm/lora/resolver.py) when a request names a model it does not serve yet, if the server runs
with --enable-lora and VLLM_ALLOW_RUNTIME_LORA_UPDATING=True; this one answers from `<directory>/<name>/` and from
nothing else: a name that is not one plain path component, a link, or a directory without `adapter_config.json` is
None, and vLLM answers 404. Registered through its own entry point in `vllm.general_plugins` (`weightcache-lora`),
only where the variable is set; importing this module needs neither vLLM nor torch.
"""

from __future__ import annotations

import asyncio
import os
import re
import stat
import threading
from typing import Any

ADAPTERS_PATH_ENV = "WEIGHTCACHE_ADAPTERS_PATH"  # weightcache.vocabulary.ADAPTERS_PATH_ENV (the pod has no daemon)
ADAPTER_CONFIG = "adapter_config.json"
RESOLVER_NAME = "weightcache"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")
_lock = threading.Lock()
_registered = False


def adapter_path(directory: str, lora_name: str) -> str | None:
    """`<directory>/<lora_name>` when it is a whole adapter there (a real directory holding a regular
    `adapter_config.json`), else None. The name comes from a request: anything but one plain component is None."""
    if not _NAME.fullmatch(lora_name) or ".." in lora_name:
        return None
    path = os.path.join(directory, lora_name)
    try:
        config = os.path.join(path, ADAPTER_CONFIG)
        whole = stat.S_ISDIR(os.lstat(path).st_mode) and stat.S_ISREG(os.lstat(config).st_mode)
    except OSError:
        return None
    return path if whole else None


def register() -> None:
    """Register the resolver with vLLM where $WEIGHTCACHE_ADAPTERS_PATH is set (once per process)."""
    global _registered
    directory = os.environ.get(ADAPTERS_PATH_ENV)
    if not directory:
        return
    with _lock:
        if _registered:
            return
        from vllm.lora.resolver import LoRAResolverRegistry

        LoRAResolverRegistry.register_resolver(RESOLVER_NAME, _resolver(directory))
        _registered = True


def _resolver(directory: str) -> Any:
    from vllm.lora.request import LoRARequest
    from vllm.lora.resolver import LoRAResolver

    class WeightcacheLoRAResolver(LoRAResolver):
        async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
            path = await asyncio.to_thread(adapter_path, directory, lora_name)  # the mount may be slow: off the loop
            if path is None:
                return None
            return LoRARequest(lora_name=lora_name, lora_int_id=1, lora_path=path)  # vLLM gives it its own id

    return WeightcacheLoRAResolver()
