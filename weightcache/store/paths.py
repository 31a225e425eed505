"""Object keys become snapshot paths only through here.

A key from the source is hostile until proven otherwise: it must be a relative, normalised, '/'-separated path
whose every segment is a legal file name, and no key may be both a file and a directory of another key.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from weightcache.errors import HostileKeyError

MAX_NAME_BYTES = 255  # NAME_MAX
# PATH_MAX is 4096 for the whole path: the store root and snapshot id, or a pod's mount path, come first
MAX_PATH_BYTES = 3072
MAX_DEPTH = 64  # directories in one key; real models nest a few levels
MAX_FILES = 100_000  # objects in one model
_CONTROL = re.compile(r"[\x00-\x1f]")


def validate_relpath(key: str) -> str:
    """Return `key` unchanged when it is a safe relative path; raise HostileKeyError naming it otherwise."""
    if not key:
        raise HostileKeyError(key, "empty path")
    if "\0" in key:
        raise HostileKeyError(key, "contains a NUL byte")
    if _CONTROL.search(key):
        raise HostileKeyError(key, "contains a control character")
    if "\\" in key:
        raise HostileKeyError(key, "contains a backslash")
    if key.startswith("/"):
        raise HostileKeyError(key, "absolute path")
    try:
        size = len(key.encode())
    except UnicodeEncodeError:  # a name a file:// source holds as raw bytes (surrogate escapes): no manifest takes it
        raise HostileKeyError(key, "not valid UTF-8") from None
    if size > MAX_PATH_BYTES:
        raise HostileKeyError(key, f"path longer than {MAX_PATH_BYTES} bytes (PATH_MAX less room for the mount)")
    if key.count("/") >= MAX_DEPTH:
        raise HostileKeyError(key, f"more than {MAX_DEPTH} directories deep")
    for part in key.split("/"):
        if part in ("", ".", ".."):
            raise HostileKeyError(key, f"path segment {part!r} is not allowed (empty, '.' or '..')")
        if len(part.encode()) > MAX_NAME_BYTES:
            raise HostileKeyError(key, f"a name is longer than {MAX_NAME_BYTES} bytes")
    return key


def validate_tree(keys: Iterable[str]) -> list[str]:
    """Validate every key and refuse duplicates, keys that are both a file and a directory, and more than
    MAX_FILES keys."""
    files = sorted(validate_relpath(k) for k in keys)
    if len(files) > MAX_FILES:
        raise HostileKeyError(files[MAX_FILES], f"the model has {len(files)} files, more than {MAX_FILES}; "
                                                "narrow it with --include/--exclude")
    seen = set()
    dirs: set[str] = set()
    for key in files:
        if key in seen:
            raise HostileKeyError(key, "listed twice")
        seen.add(key)
        parts = key.split("/")
        dirs.update("/".join(parts[:i]) for i in range(1, len(parts)))
    clash = sorted(seen & dirs)
    if clash:
        raise HostileKeyError(clash[0], "is both a file and a directory of another key")
    return files
