"""The store's small files, written and read in one place: manifests, refs and leases are data, never code.

Everything read back from disk is checked before use: JSON of the right shape, hex digests of the right length,
safe relative paths, integer sizes in range, a manifest whose id is the digest of its files. Anything else
raises DamagedRecordError (the caller quarantines the file), so a record planted or damaged on disk can neither
crash startup nor point an operation outside the root.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec

from weightcache.errors import DamagedRecordError, HostileKeyError
from weightcache.store.paths import validate_tree
from weightcache.store.types import FileEntry

MANIFEST_VERSION = 1
SHA256_HEX = 64
SNAPSHOT_ID_HEX = 40
MAX_SIZE = (1 << 63) - 1  # what SQLite's INTEGER holds
MAX_MANIFEST_BYTES = 256 << 20
MAX_SMALL_RECORD_BYTES = 64 << 10  # refs and leases
_HEX = frozenset("0123456789abcdef")
_ENCODE = msgspec.json.Encoder().encode  # a file entry (a dataclass) as one JSON object, in C


def is_hex(value: object, length: int) -> bool:
    """Lowercase hex of exactly `length` characters (what the store writes for digests and snapshot ids)."""
    return isinstance(value, str) and len(value) == length and _HEX.issuperset(value)


def is_snapshot_id(value: object) -> bool:
    return is_hex(value, SNAPSHOT_ID_HEX)


def tree_digest(files: Iterable[FileEntry]) -> str:
    """sha256 (64 hex) of (path, size, sha256) of every file, sorted by path: the tree's content digest."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.path):
        h.update(f"{f.path}\0{f.size}\0{f.sha256}\n".encode())
    return h.hexdigest()


def snapshot_id_for(files: Iterable[FileEntry]) -> str:
    """The first 40 hex of the tree digest: the same tree gets the same id, whoever fetched it."""
    return tree_digest(files)[:SNAPSHOT_ID_HEX]


@dataclass(frozen=True)
class Manifest:
    """A snapshot's commit marker: what `manifests/<id>.json` holds."""

    id: str
    uri: str
    revision: str | None
    created: float
    files: tuple[FileEntry, ...]
    # path -> what verified its bytes against the source (vocabulary.SOURCE_CHECKS); a top-level key of its own,
    # which a release before it ignores (its file entries take no unknown field), empty in manifests before it
    checks: Mapping[str, str] = field(default_factory=dict)
    # what verified its model.sig (signatures.SignatureRecord.to_json), when a signature was asked for: a top-level
    # key of its own like `checks`, absent otherwise
    signature: Mapping[str, str | int] = field(default_factory=dict)


@dataclass(frozen=True)
class RefRecord:
    """`refs/<model-key>/<name>`: which snapshot a reference resolves to."""

    snapshot: str
    uri: str
    revision: str | None


# -- writing ----------------------------------------------------------------------------------------------------
def manifest_bytes(m: Manifest) -> bytes:
    """JSON with one file per line: readable, and each line made by msgspec's encoder (indent= would use json's
    pure-Python one: 2,000 files took 45 ms; json.dumps per line 5 ms, msgspec 0.6 ms)."""
    fields = {"version": MANIFEST_VERSION, "id": m.id, "uri": m.uri, "revision": m.revision, "created": m.created}
    if m.checks:
        fields["checks"] = dict(sorted(m.checks.items()))
    if m.signature:
        fields["signature"] = dict(m.signature)
    head = json.dumps(fields)
    files = b",\n ".join(map(_ENCODE, m.files))
    return b'%s, "files": [\n %s\n]}\n' % (head[:-1].encode(), files)


def ref_bytes(r: RefRecord, include: Iterable[str] = (), exclude: Iterable[str] = ()) -> bytes:
    return json.dumps({"snapshot": r.snapshot, "uri": r.uri, "revision": r.revision, "include": list(include),
                       "exclude": list(exclude)}).encode()


def lease_bytes(snapshot_id: str) -> bytes:
    return (snapshot_id + "\n").encode()


# -- reading ----------------------------------------------------------------------------------------------------
def parse_manifest(data: bytes, snapshot_id: str) -> Manifest:
    """The manifest in `data`, which must be the one of `snapshot_id`; DamagedRecordError otherwise."""
    obj = _object(data, "manifest")
    if obj.get("version") != MANIFEST_VERSION:
        raise DamagedRecordError(f"manifest version {obj.get('version')!r} is not {MANIFEST_VERSION}")
    if obj.get("id") != snapshot_id or not is_snapshot_id(snapshot_id):
        raise DamagedRecordError(f"manifest id {obj.get('id')!r} does not match its file name {snapshot_id!r}")
    created = obj.get("created")
    if isinstance(created, bool) or not isinstance(created, (int, float)) or not math.isfinite(created):
        raise DamagedRecordError(f"manifest 'created' is not a finite number: {created!r}")
    raw = obj.get("files")
    if not isinstance(raw, list):
        raise DamagedRecordError("manifest 'files' is not a list")
    files = tuple(file_entry(f) for f in raw)
    try:
        validate_tree(f.path for f in files)
    except HostileKeyError as exc:
        raise DamagedRecordError(f"manifest file list: {exc}") from None
    if snapshot_id_for(files) != snapshot_id:
        raise DamagedRecordError("manifest files do not hash to its snapshot id (edited after publish?)")
    return Manifest(snapshot_id, _string(obj, "uri"), _optional_string(obj, "revision"), float(created), files,
                    manifest_checks(obj, {f.path for f in files}), manifest_signature(obj))


_CHECK_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,31}")


def manifest_checks(obj: Mapping[str, object], paths: set[str] | None = None) -> dict[str, str]:
    """A manifest's `checks` (path -> what verified it), read leniently: it describes, it decides nothing already
    stored, so an entry that is not a known path with a short lowercase name (a later release's name is kept) is
    left out rather than the manifest refused."""
    raw = obj.get("checks")
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str) and _CHECK_NAME.fullmatch(v)
            and (paths is None or k in paths)}


_SIGNATURE_KEYS = {"method": str, "signer": str, "bundle_sha256": str, "files": int}


def manifest_signature(obj: Mapping[str, object]) -> dict[str, str | int]:
    """A manifest's `signature` record, read leniently like `checks` (it describes what verified the snapshot; the
    fetch engine checks a signature again from model.sig whenever one is asked for): the known fields of the
    right type and size, or nothing."""
    raw = obj.get("signature")
    if not isinstance(raw, dict):
        return {}
    return {k: v for k, v in raw.items() if k in _SIGNATURE_KEYS and type(v) is _SIGNATURE_KEYS[k]
            and isinstance(v, (str, int)) and (not isinstance(v, str) or len(v) <= 512)}


def file_entry(value: object) -> FileEntry:
    """One checked file entry (a manifest's or an index row's)."""
    if not isinstance(value, dict) or not value.keys() <= {"path", "size", "sha256", "etag", "version_id"}:
        raise DamagedRecordError(f"file entry is not an object with path, size, sha256: {_short(value)}")
    path, size, sha = value.get("path"), value.get("size"), value.get("sha256")
    if not isinstance(path, str):
        raise DamagedRecordError(f"file path is not a string: {_short(path)}")
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_SIZE:
        raise DamagedRecordError(f"file {path!r}: size {_short(size)} is not an integer in 0..{MAX_SIZE}")
    if not is_hex(sha, SHA256_HEX):
        raise DamagedRecordError(f"file {path!r}: sha256 {_short(sha)} is not {SHA256_HEX} lowercase hex digits")
    return FileEntry(path, size, str(sha), _optional_string(value, "etag"), _optional_string(value, "version_id"))


def parse_ref(data: bytes) -> RefRecord:
    obj = _object(data, "ref")
    snap = obj.get("snapshot")
    if not is_snapshot_id(snap):
        raise DamagedRecordError(f"ref names snapshot {_short(snap)}, not a snapshot id")
    return RefRecord(str(snap), _string(obj, "uri"), _optional_string(obj, "revision"))


def parse_lease(data: bytes) -> str:
    """The snapshot id a lease file holds."""
    text = data.decode("ascii", errors="replace").strip()
    if not is_snapshot_id(text):
        raise DamagedRecordError(f"lease holds {_short(text)}, not a snapshot id")
    return text


def _object(data: bytes, what: str) -> dict[str, Any]:
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise DamagedRecordError(f"{what} is not JSON ({str(exc)[:80]})") from None
    if not isinstance(value, dict):
        raise DamagedRecordError(f"{what} is not a JSON object")
    return value


def _string(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key)
    if not isinstance(value, str):
        raise DamagedRecordError(f"{key!r} is not a string: {_short(value)}")
    return value


def _optional_string(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    return None if value is None else _string(obj, key)


def _short(value: object) -> str:
    try:
        text = repr(value)
    except (RecursionError, ValueError):  # deeply nested JSON
        return "<an unreadable value>"
    return text if len(text) <= 80 else text[:77] + "..."
