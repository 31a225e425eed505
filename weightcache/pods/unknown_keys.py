"""`weightcache.io/` annotation keys the webhook does not know: a typo (`weightcache.io/modle`) silently does
nothing, so the webhook names the nearest known key, as AdmissionReview `warnings` (the default) or in a denial
(`weightcache webhook --unknown-annotations=deny`).

Pure: annotations in, texts out. The API server shows each warning to the client (kubectl prints them); it asks for
warnings under 120 characters and few of them, so at most MAX_WARNINGS are sent, each under 120 characters,
whatever keys a pod carries (the key's name part is cut in the middle when long).
"""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Literal

from weightcache.errors import AnnotationError
from weightcache.pods.annotations import KNOWN, PREFIX
from weightcache.vocabulary import VIA_ANNOTATION as VIA

KNOWN_KEYS: tuple[str, ...] = (*KNOWN, VIA)
MAX_WARNINGS = 10
Mode = Literal["warn", "deny"]  # vocabulary.UNKNOWN_ANNOTATION_MODES: the webhook command's choices
_NAMES = {k[len(PREFIX):]: k for k in KNOWN_KEYS}
_SHOWN = 24  # characters of an unknown key's name shown; longer ones are cut in the middle


def unknown(annotations: Mapping[str, object]) -> list[str]:
    """The pod's `weightcache.io/` keys that are not known, sorted."""
    return sorted(k for k in annotations if isinstance(k, str) and k.startswith(PREFIX) and k not in KNOWN_KEYS)


def nearest(key: str) -> str | None:
    """The known key `key` most likely meant (difflib over the names after `weightcache.io/`), or None."""
    name = key[len(PREFIX):] if key.startswith(PREFIX) else key
    close = difflib.get_close_matches(name.lower().replace("_", "-"), list(_NAMES), n=1, cutoff=0.6)
    return _NAMES[close[0]] if close else None


def hint(key: str) -> str:
    """One warning for `key`, under 120 characters."""
    near = nearest(key)
    shown = PREFIX + _cut(key[len(PREFIX):])
    if near:
        return f"unknown annotation {shown} does nothing; did you mean {near}?"
    return f"unknown annotation {shown} does nothing (docs/webhook.md lists the known ones)"


def warnings(annotations: Mapping[str, object]) -> list[str]:
    """At most MAX_WARNINGS warnings, one per unknown key; the last one counts the keys left out."""
    keys = unknown(annotations)
    if len(keys) <= MAX_WARNINGS:
        return [hint(k) for k in keys]
    shown = [hint(k) for k in keys[: MAX_WARNINGS - 1]]
    return [*shown, f"and {len(keys) - len(shown)} more unknown {PREFIX}* annotations, ignored"]


def check(annotations: Mapping[str, object], mode: Mode = "warn") -> list[str]:
    """The warnings to send (mode warn), or AnnotationError naming them (mode deny, when there are any)."""
    found = warnings(annotations)
    if found and mode == "deny":
        raise AnnotationError("; ".join(found) + " (this webhook refuses unknown annotations: "
                              "--unknown-annotations=deny)")
    return found


def _cut(name: str) -> str:
    printable = "".join(c if c.isprintable() and c.isascii() else "?" for c in name)
    if len(printable) <= _SHOWN:
        return printable
    half = (_SHOWN - 3) // 2
    return f"{printable[:half]}...{printable[-half:]}"
