"""The store's free-space floor and disk budget as operators set them, and the file that keeps them with the store.

A command's own setting comes from its flags, else WEIGHTCACHE_MIN_FREE_BYTES / _PERCENT (`floor_from`; one reading
for the daemon's config and the CLI). What the daemon, or a command given a flag, set is written to the store's
root, and every command that sets nothing reads it there, else the defaults (weightcache.defaults):

    <store root>/limits.json   {"version": "1.0", "min_free_bytes": 1073741824, "min_free_percent": 10.0,
                                "budget_bytes": null, "set_by": "daemon"}

So a plain `weightcache gc`, `evict` or a store recovery keeps the floor the model was fetched under (a model
fetched with `--min-free-bytes 0` on a small disk is not evicted by the next `gc` for a floor it was never
given), and a direct `prefetch` on a node keeps the daemon's budget. A damaged file is quarantined and reads as
nothing set.
"""

from __future__ import annotations

import json
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from weightcache import defaults
from weightcache.errors import ConfigError
from weightcache.store.layout import Layout
from weightcache.units import fmt_bytes, parse_size

log = logging.getLogger(__name__)

ENV_BYTES = "WEIGHTCACHE_MIN_FREE_BYTES"
ENV_PERCENT = "WEIGHTCACHE_MIN_FREE_PERCENT"
MAX_PERCENT = 90.0
LIMITS_FILE = "limits.json"
_VERSION = "1.0"
MAX_BYTES = (1 << 63) - 1


@dataclass(frozen=True)
class SpaceLimits:
    """A store's floor and budget: None is what nobody set (the defaults' floor, no budget)."""

    min_free_bytes: int | None = None
    min_free_percent: float | None = None
    budget_bytes: int | None = None
    set_by: str = ""  # who wrote them: "daemon", "cli"

    def merged(self, other: SpaceLimits) -> SpaceLimits:
        """These, with `other`'s values where these are None."""
        return SpaceLimits(_first(self.min_free_bytes, other.min_free_bytes),
                      _first(self.min_free_percent, other.min_free_percent),
                      _first(self.budget_bytes, other.budget_bytes), self.set_by or other.set_by)


def _first(a: Any, b: Any) -> Any:
    return a if a is not None else b


def read_limits(layout: Layout) -> SpaceLimits:
    """What the store's limits file says (SpaceLimits() when there is none, or it is damaged: then quarantined)."""
    path = layout.root / LIMITS_FILE
    data = layout.tree.read(path, limit=4096)
    if data is None:
        return SpaceLimits()
    try:
        obj = json.loads(data)
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        return SpaceLimits(_count(obj.get("min_free_bytes"), "min_free_bytes"),
                      _share(obj.get("min_free_percent")), _count(obj.get("budget_bytes"), "budget_bytes"),
                      str(obj.get("set_by") or "")[:40])
    except (ValueError, TypeError, RecursionError) as exc:
        layout.tree.quarantine(path, f"is not the store's limits ({str(exc)[:200]})")
        return SpaceLimits()


def write_limits(layout: Layout, limits: SpaceLimits) -> None:
    """Keep `limits` with the store (atomic; a full disk that refuses the write costs a warning, not the command)."""
    body = {"version": _VERSION, "min_free_bytes": limits.min_free_bytes, "min_free_percent": limits.min_free_percent,
            "budget_bytes": limits.budget_bytes, "set_by": limits.set_by}
    try:
        layout.tree.write_atomic(layout.root / LIMITS_FILE, json.dumps(body, sort_keys=True).encode())
    except OSError as exc:
        log.warning("could not keep the store's floor and budget in %s (%s): other commands use their own or "
                    "the defaults", layout.root / LIMITS_FILE, exc)


def _count(value: object, what: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_BYTES:
        raise ValueError(f"{what} is not a byte count")
    return value


def _share(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or not 0 <= value <= MAX_PERCENT:
        raise ValueError("min_free_percent is not a percentage")
    return float(value)


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
               min_free_percent: float | None = None) -> tuple[int | None, float | None]:
    """(bytes, percent): each from its flag when given, else its environment variable, else None (not set here:
    the store's own, else the default)."""
    if min_free_bytes is None:
        text = env.get(ENV_BYTES)
        min_free_bytes = parse_size(text, ENV_BYTES) if text else None
    if min_free_percent is None:
        text = env.get(ENV_PERCENT)
        min_free_percent = parse_percent(text, ENV_PERCENT) if text else None
    return min_free_bytes, min_free_percent


def defaulted(limits: SpaceLimits) -> tuple[int, float]:
    """The floor in force: (bytes, percent), the defaults where nobody set them."""
    return (_first(limits.min_free_bytes, defaults.MIN_FREE_BYTES),
            _first(limits.min_free_percent, defaults.MIN_FREE_PERCENT))


def full_disk_advice(root: str | os.PathLike[str]) -> str:
    """What to do when the filesystem of `root` (the store's root) is full, in words that work: every change to the
    store (an eviction and gc included) writes its index, so once the store's reserve is spent nothing in the store
    can free space until something outside it does. Says how much is the store's and how much other files', and
    how to find those (a walk of the store: only when the disk is full)."""
    st = os.statvfs(root)
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    mount = _mount_point(os.fspath(root))
    store_bytes = _allocated(os.fspath(root))
    share = (f"the store takes {fmt_bytes(store_bytes)} of its {fmt_bytes(size)} and other files "
             f"{fmt_bytes(max(0, size - free - store_bytes))}; ")
    return (f"{share}weightcache evict and gc record what they remove in the store's index too, so they fail the "
            f"same way until a few MiB are free: first free space outside the store (the largest files: `du -xh "
            f"--max-depth=2 {mount} | sort -h | tail`; container logs, images, pods' data, or whatever filled it), "
            f"then `weightcache evict --to-size SIZE` frees more if the store must shrink; a disk or quota of the "
            f"store's own keeps other writers from filling it")


def _allocated(root: str) -> int:
    """Bytes allocated to the files under `root`, each inode once (snapshots hard-link blobs); links not followed."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for folder, _, files in os.walk(root):
        for name in files:
            try:
                st = os.lstat(os.path.join(folder, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in seen:
                seen.add((st.st_dev, st.st_ino))
                total += st.st_blocks * 512
    return total


def _mount_point(path: str) -> str:
    path = os.path.realpath(path)
    while not os.path.ismount(path) and path != os.path.dirname(path):
        path = os.path.dirname(path)
    return path
