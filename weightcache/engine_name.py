"""The name an engine cache is asked for, `vllm-0.32.0-cpu[-<compile key>]`: engine, engine version, device kind
and, optionally, the engine's compile key (16 hex: what its compile cache depends on, its compilation config and
the options that change it, hashed the way the engine keys its own cache; the weightcache vLLM plugin computes it
and says it in the pod's EngineCache* Event). With a compile key, caches of other compile settings are other keys.

Pure and at the foundation, because three layers read it: the pod annotation `weightcache.io/engine-cache` (the
webhook, which must not load the store), the CSI volume attribute `engineCache` and the daemon's
`/v1/engine-caches/{name}` (both through weightcache/engine_cache.py). The name is a promise the requester
makes about the bytes, never checked against them (docs/engine-caches.md, "the trust domain").
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from weightcache.errors import InvalidRequestError

_ENGINE = re.compile(r"[a-z][a-z0-9_]{0,31}")
_VERSION = re.compile(r"[0-9A-Za-z][0-9A-Za-z.+_]{0,63}")
_DEVICE = re.compile(r"[a-z0-9][a-z0-9_.]{0,31}")
_COMPILE = re.compile(r"[0-9a-f]{16}")


def invalid(message: str) -> InvalidRequestError:
    """An engine cache request refused: 400 / INVALID_ARGUMENT `engine cache: <message>` (engine_cache uses it)."""
    return InvalidRequestError("engine cache", message)


@dataclass(frozen=True)
class EngineName:
    """What the requester declares: engine, its version, the device kind and optionally the compile key, written
    `vllm-0.32.0-cpu` or `vllm-0.32.0-cpu-3f2a9c1b0d4e5f60`."""

    engine: str
    version: str
    device: str
    compile: str = ""

    def __post_init__(self) -> None:
        for value, pattern, what, example in ((self.engine, _ENGINE, "engine", "vllm"),
                                              (self.version, _VERSION, "version", "0.32.0"),
                                              (self.device, _DEVICE, "device", "cpu, h100, mi300x")):
            if not isinstance(value, str) or not pattern.fullmatch(value):
                raise invalid(f"{what} {str(value)[:80]!r} is not a valid {what} name (like {example}; no '-')")
        if self.compile and not (isinstance(self.compile, str) and _COMPILE.fullmatch(self.compile)):
            raise invalid(f"compile key {str(self.compile)[:80]!r} is not 16 lower-case hex digits")

    @classmethod
    def parse(cls, text: str) -> EngineName:
        """`vllm-0.32.0-cpu` -> EngineName('vllm', '0.32.0', 'cpu'); a fourth part is the compile key."""
        parts = text.split("-") if isinstance(text, str) else []
        if len(parts) not in (3, 4):
            raise invalid(f"{str(text)[:80]!r} is not ENGINE-VERSION-DEVICE[-COMPILEKEY], like vllm-0.32.0-cpu")
        return cls(*parts)

    def __str__(self) -> str:
        return f"{self.engine}-{self.version}-{self.device}" + (f"-{self.compile}" if self.compile else "")


__all__ = ["EngineName", "invalid"]
