"""The signature phase of a fetch: model.sig checked against the grant's requirements (weightcache/signatures.py)
from the digests the fetch computed, before anything names the snapshot, and again on a cache hit of a snapshot
published for a request that asked none. Only model.sig's blob is read; no model file is read twice."""

from __future__ import annotations

from collections.abc import Iterable

from weightcache.access import Grant
from weightcache.signatures import MAX_BUNDLE_BYTES, SIGNATURE_FILE, SignatureRecord, verify
from weightcache.store import FileEntry, Store


def check(grant: Grant, store: Store, files: Iterable[FileEntry]) -> SignatureRecord | None:
    """What verified these files under `grant.signatures` (None when it asks for none); SignatureError else."""
    if not grant.signatures:
        return None
    digests = {f.path: f.sha256 for f in files}

    def read_bundle() -> bytes | None:
        blob = digests[SIGNATURE_FILE]
        size = store.blob_size(blob)
        if size is None or size > MAX_BUNDLE_BYTES:  # checked first: the tree's read quarantines what is over
            return None
        return store.tree.read(store.layout.blob(blob), limit=MAX_BUNDLE_BYTES)

    return verify(grant.signatures, digests, read_bundle=read_bundle, selected=grant.ref.matches)
