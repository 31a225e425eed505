"""The store's free-space floor as operators set it: flags, else WEIGHTCACHE_MIN_FREE_BYTES / _PERCENT, else the
defaults (weightcache.defaults). One reading for the daemon's config and the CLI, so a direct `weightcache
prefetch` on a node keeps the same floor as the daemon beside it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from weightcache import defaults
from weightcache.errors import ConfigError
from weightcache.units import parse_size

ENV_BYTES = "WEIGHTCACHE_MIN_FREE_BYTES"
ENV_PERCENT = "WEIGHTCACHE_MIN_FREE_PERCENT"
MAX_PERCENT = 90.0


def parse_percent(value: Any, what: str) -> float:
    """A share of the disk to keep free, 0 to 90; ConfigError naming `what` otherwise."""
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        number = -1.0
    if not 0 <= number <= MAX_PERCENT:  # also refuses nan
        raise ConfigError(f"{what}: expected a percentage of the disk between 0 and {MAX_PERCENT:.0f} (e.g. 11), "
                          f"got {str(value)[:40]!r}")
    return number


def floor_from(env: Mapping[str, str], *, min_free_bytes: int | None = None,
               min_free_percent: float | None = None) -> tuple[int, float]:
    """(bytes, percent): each from its flag when given, else its environment variable, else the default."""
    if min_free_bytes is None:
        text = env.get(ENV_BYTES)
        min_free_bytes = parse_size(text, ENV_BYTES) if text else defaults.MIN_FREE_BYTES
    if min_free_percent is None:
        text = env.get(ENV_PERCENT)
        min_free_percent = parse_percent(text, ENV_PERCENT) if text else defaults.MIN_FREE_PERCENT
    return min_free_bytes, min_free_percent
