"""Grants for tests that drive the fetch engine directly: the admin's decision (weightcache/access.py), as the
direct CLI takes it. The engine takes nothing else, so these go through `Authority.authorize` like every door."""

from __future__ import annotations

from typing import Any

from weightcache.access import ADMIN, Authority, Grant
from weightcache.uri import ModelRef, parse_ref


def admin(ref: ModelRef) -> Grant:
    """The node admin's grant of `ref` (no ModelCaches, undeclared models allowed; file:// rules still apply)."""
    return Authority().authorize(ref, ADMIN)


def granted(text: str, **kwargs: Any) -> Grant:
    """admin(parse_ref(text, **kwargs))."""
    return admin(parse_ref(text, **kwargs))
