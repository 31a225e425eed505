"""The publish phase of a fetch: each downloaded file verified (its sha256, the source's check, a safetensors
header) and made a blob, then the snapshot published once one syncfs made the blobs durable. A file streamed to
`on_file` becomes durable alone, as soon as it is verified (`durable`).

Blobs are named with syncfs calls instead of three fsyncs each (2,000 small files: seconds -> tens of ms)."""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

from weightcache.access import Grant
from weightcache.download import sync_filesystem
from weightcache.errors import IntegrityError, SafetensorsHeaderError
from weightcache.fetch import signed
from weightcache.fetch.handover import HandOver
from weightcache.fetch.items import Item, partial, serve_partials
from weightcache.peers.identity import COMPOSITE
from weightcache.sources import Source
from weightcache.store import BlobWriter, FileEntry, Snapshot, Store, validate_tree
from weightcache.vocabulary import NO_SOURCE_CHECK

if TYPE_CHECKING:
    from weightcache.peers import PeerSet

log = logging.getLogger(__name__)

Expand = Callable[[list[FileEntry], Store], list[FileEntry]]


def verified(item: Item, source: Source) -> str:
    """The sha256 of a fully hashed download once it matches what it must (IntegrityError when not)."""
    part = partial(item)
    sha = part.sha256.hexdigest()
    if item.expect_sha256 and sha != item.expect_sha256:
        raise IntegrityError(f"{item.relpath}: sha256 {sha} does not match the expected {item.expect_sha256}")
    if item.source_check is not None and part.source_check is not None:
        algorithm, want = item.source_check
        if algorithm == "md5" and item.obj.checksum is None:  # an ETag (not a listed MD5: gs://, az://): a GET
            # may have shown SSE-KMS/SSE-C since planning, and then the ETag is no MD5
            want = source.etag_md5(item.obj) or ""
            if not want:
                item.check = NO_SOURCE_CHECK
        got = part.source_check.hexdigest()
        if want and want not in got.split():  # a multipart ETag of inferred part sizes: one digest each
            # where the store does not say the part size (Ceph radosgw 16), a mismatch is other bytes or parts of
            # a size not tried: say so, one size tried or several, so valid bytes do not read as corruption alone
            hint = ""
            if algorithm.startswith(COMPOSITE) and ("," in algorithm or source.part_sizes_guessed(item.obj)):
                tried = ", ".join(f"{int(n) / (1 << 20):g} MiB" for n in algorithm[len(COMPOSITE):].split(","))
                hint = (f" (the store does not say its part size; tried {tried}: an object uploaded in parts of "
                        "another size differs too and cannot be checked here; upload it with a checksum, "
                        "e.g. aws s3 cp --checksum-algorithm SHA256)")
            raise IntegrityError(f"{item.relpath}: {algorithm} {got} does not match the source's {want}{hint}")
    return sha


def check_header(item: Item, path: str | Path) -> None:
    """The safetensors header check of a downloaded file, read through `path` (a part, or /proc/self/fd/N of an
    unnamed blob), naming the file of the model: the check names what it read, a name that means nothing to the
    user, so that name is dropped from its message."""
    from weightcache.safetensors_check import check_file

    try:
        check_file(path)
    except SafetensorsHeaderError as exc:
        problem = str(exc).removeprefix(f"{Path(path).name}: ")
        raise SafetensorsHeaderError(f"{item.relpath}: {problem}; the model at the source is damaged or not "
                                     f"safetensors: fix or exclude that file") from exc


def write_whole(item: Item, data: memoryview, source: Source, blobs: BlobWriter) -> None:
    """A file read whole in one request: hashed from the worker's buffer, so its digest is known before any
    byte is written; verified, it goes straight to its blob (store/blobwrite.py), else to a part as before.
    A file failing verification is not written at all: finish says why and it is fetched again. One failing
    its header check is not written either: finish raises that refusal after the round, while the other
    files of the round become blobs for a rerun."""
    part = partial(item)
    part.hash_whole(data)
    try:
        sha = verified(item, source)
    except IntegrityError:
        return
    check = functools.partial(check_header, item) if item.relpath.endswith(".safetensors") else None
    try:
        item.in_blob = blobs.write(sha, data, check)
    except SafetensorsHeaderError as exc:
        item.header_error = exc
        return
    if item.in_blob:
        item.sha256 = sha  # verified: finish need not hash-compare it again
    else:
        part.write_whole_part(data)


def finish(item: Item, source: Source) -> None:
    """Verify a fully downloaded file and validate safetensors headers; add_blobs moves it into blobs/."""
    part = partial(item)
    if item.header_error is not None:  # refused before it was named: never checked (nor its workers run) twice
        part.discard()
        raise item.header_error
    if not part.complete:
        part.hash_resumed(memoryview(bytearray(4 << 20)))
    sha = item.sha256 if item.in_blob and item.sha256 else verified(item, source)  # in_blob: verified already
    if item.relpath.endswith(".safetensors") and not item.in_blob:  # in_blob: checked before it was named
        try:
            check_header(item, part.part)
        except SafetensorsHeaderError:
            part.discard()  # a retry must not find it and check it again
            raise
    item.size = part.written_size()
    part.close()
    item.sha256 = sha


def durable(item: Item, source: Source, store: Store, handover: HandOver, peers: PeerSet | None) -> None:
    """on_file's file finished in the round: verified and made a blob now, durable by its own fsyncs (the
    file, its blob directory) rather than the model's syncfs, and handed over. One that fails verification
    or its header check is left to the round's end, which refetches or refuses it as without on_file."""
    if not handover.claim(item):  # the worker that hashed the last bytes, or another that saw it done
        return
    try:
        finish(item, source)
    except IntegrityError:
        handover.unclaim(item)
        return
    except SafetensorsHeaderError as exc:
        item.header_error = exc  # finish discarded it; the round's end raises this
        handover.unclaim(item)
        return
    sha = item.sha256 or ""
    if item.in_blob:
        store.sync_blob(sha)
    else:
        store.add_blob(partial(item).part, sha, durable=True)
        if partial(item).journalled:
            partial(item).journal.unlink(missing_ok=True)
    # served as a download until it is the blob: a peer's HEAD between the two (the fsyncs) found neither, took
    # this node for idle and read its share, finished a moment before, from the origin (1 run in 4 on a busy box)
    serve_partials(peers, [item], False)
    item.reported = True
    handover.give(item)


def add_blobs(store: Store, items: list[Item]) -> None:
    """Verified files become blobs. Whole small files are in their blobs already (store/blobwrite.py). Parts move
    to their blobs once a syncfs made their data durable (before a moved name promises it). The caller's syncfs,
    last, makes the new names (and the small files' bytes) durable."""
    parts = [item for item in items if not item.in_blob and not item.reported]
    if not parts:
        return
    sync_filesystem(store.layout.partial)
    store.add_blobs(((partial(item).part, item.sha256 or "") for item in parts), durable=False)
    for item in parts:
        if partial(item).journalled:
            partial(item).journal.unlink(missing_ok=True)


def keep_verified(store: Store, items: list[Item]) -> None:
    """A fetch failed: its verified files become durable blobs all the same, so a rerun reuses them."""
    done = [i for i in items if i.sha256]
    add_blobs(store, done)
    if done:
        sync_filesystem(store.layout.partial)


def publish(grant: Grant, store: Store, items: list[Item], *, downloaded: bool, expand: Expand,
            checked: Callable[[dict[str, str]], None] | None = None) -> Snapshot:
    """The snapshot of every listed file (tar layers replaced by their members: `expand`, sources/oci_tar.py),
    once its model.sig satisfies the grant's signature requirements (signed.py: SignatureError, nothing named).
    One syncfs makes the new blobs' bytes and names durable, and those of blobs linked on a checksum alone
    (another fetch may have named them before their bytes synced). The disk works while publish links the
    tree (2,000 small files: ~30 ms of each, overlapped); publish waits for it before the tree is renamed
    into place. `checked` is told what verified each file this fetch published (the manifest keeps the first
    record of a snapshot: the same files fetched from another store have the same snapshot id)."""
    listed = [FileEntry(i.relpath, i.size, i.sha256 or "", i.obj.etag, i.obj.version_id) for i in items]
    entries = expand(listed, store)  # `listed` itself: none to expand
    if entries is not listed:
        validate_tree(e.path for e in entries)  # members of two layers must not collide, nor with files
    signature = signed.check(grant, store, entries)
    unsynced = downloaded or entries is not listed or any(i.unsynced_blob for i in items)
    with ThreadPoolExecutor(1, thread_name_prefix="wc-syncfs") as pool:
        synced = pool.submit(sync_filesystem, store.layout.partial) if unsynced else None
        checks = _checks_of(items, entries)
        snap = store.publish(grant.ref, entries, before_commit=synced.result if synced else None, checks=checks,
                             signature=signature.to_json() if signature is not None else None)
    if checked is not None:
        checked(checks)
    return snap


def _checks_of(items: list[Item], entries: list[FileEntry]) -> dict[str, str]:
    """Each published file's check: its item's, or for a tar layer's member (oci://) its layer's, by the layer
    digest both carry as their etag."""
    by_path = {i.relpath: i.check for i in items}
    by_etag = {i.obj.etag: i.check for i in items if i.obj.etag}
    return {e.path: by_path.get(e.path) or by_etag.get(e.etag or "") or NO_SOURCE_CHECK for e in entries}
