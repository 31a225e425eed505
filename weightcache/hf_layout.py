"""Present a cached snapshot as a Hugging Face hub cache for one repo, without copying a byte.

With volume attribute `hfRepo: org/name` (annotation `weightcache.io/hf-repo`) the CSI plugin mounts this tree
instead of the plain snapshot, and the webhook points HF_HUB_CACHE at it with HF_HUB_OFFLINE=1, so
`from_pretrained("org/name")` and `huggingface_hub.snapshot_download("org/name")` resolve from the mount:

    <root>/hf/<snapshot id>/<models--org--name>/        the hub cache (HF_HUB_CACHE), what is mounted
        models--org--name/refs/main                     "<commit>": the revision every name resolves to
        models--org--name/snapshots/<commit>/<files>    HARD links to the snapshot's files (same inodes)

The hub's own cache makes snapshots/ relative symlinks into blobs/; a bind mount of a subtree breaks those as soon
as one points outside it, so regular files (hard links) are used, which huggingface_hub reads the same way. The
commit is the source's (hf:// snapshots record the 40-hex commit as their revision), else one derived from the
snapshot id, stable across nodes.

A view is built once per (snapshot, repo name) in a temporary directory and renamed into place, so a partial tree
is never visible; every path is walked with the store's no-follow tree (store/fsops.py), under the store lock.
The repo name is the pod's choice, so views are bounded: at most MAX_VIEWS_PER_SNAPSHOT names per snapshot (one
more is refused, costing only that pod), and they go when nothing holds the snapshot: `prune` (each daemon
reconcile pass) removes the views of snapshots evicted or without
a lease, under the same lock a build takes, so a view being mounted (its lease is taken first) is never removed.
Eviction removes a snapshot's views itself (Store.finish_eviction) before its blobs, so their hard links never
keep evicted bytes on disk.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import stat
from pathlib import Path

from weightcache.errors import InvalidReferenceError, InvalidRequestError
from weightcache.store import LinkTree, Snapshot, Store, tmp_name, validate_relpath
from weightcache.uri import validate_repo_id

log = logging.getLogger(__name__)

HF_DIR = "hf"
COMMIT = re.compile(r"[0-9a-f]{40}")
MAX_VIEWS_PER_SNAPSHOT = 8  # repo names one snapshot is shown as at once: a pod picks the name
_REFS = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # branch or tag names we write under refs/ (fullmatch)


def repo_folder(repo_id: str) -> str:
    """The hub cache's folder name for a model repo: models--org--name."""
    return "models--" + "--".join(validate_repo_id(repo_id).split("/"))


def commit_of(snapshot: Snapshot) -> str:
    """The commit the hub cache names: the source's when it is one (hf:// records it as every file's version),
    else derived from the snapshot id."""
    if snapshot.revision and COMMIT.fullmatch(snapshot.revision):
        return snapshot.revision
    versions = {entry.version_id for entry in snapshot.files}
    if len(versions) == 1 and snapshot.uri.startswith("hf://"):
        (version,) = versions
        if version and COMMIT.fullmatch(version):
            return version
    return hashlib.sha1(f"weightcache:{snapshot.id}".encode()).hexdigest()  # a name shaped like a commit


def hub_cache(store: Store, snapshot: Snapshot, repo_id: str, *, refs: tuple[str, ...] = ()) -> Path:
    """The hub cache directory for `repo_id` backed by `snapshot`, built on first use (blocking: call it from a
    thread) by a caller that holds a lease on the snapshot (else the next prune removes it). `refs` are extra
    names (the reference's branch or tag) that resolve to the snapshot besides main."""
    folder = repo_folder(repo_id)
    parent = store.root / HF_DIR / _safe(snapshot.id)
    final = parent / folder
    tree = store.tree
    with store.locked():  # prune removes views under this lock: never one between its build and its mount
        found = tree.lstat(final)
        if found is not None and stat.S_ISDIR(found.st_mode):
            return final
        prune(store, unleased=False)
        views = [n for n in tree.listdir(parent) if n.startswith("models--")]
        if len(views) >= MAX_VIEWS_PER_SNAPSHOT:
            raise InvalidRequestError("volume_context.hfRepo", (
                f"{repo_id!r} would be the {len(views) + 1}th repo name snapshot {snapshot.id} is shown as "
                f"(at most {MAX_VIEWS_PER_SNAPSHOT}: {', '.join(sorted(views))}); use one of those names, or "
                f"mount it once the pods using the others are gone"))
        tmp = tmp_name(final)
        try:
            names = ("main", *[r for r in refs if _REFS.fullmatch(r)])
            _build(store, tmp / folder, snapshot, commit_of(snapshot), names)
            if found is not None:  # not a directory: planted or damaged; never followed
                tree.quarantine(final, "is not a hub cache view directory")
            tree.rename(tmp, final)  # atomic: readers see no tree or a whole one
        except OSError as exc:
            tree.remove_tree(tmp)
            raise OSError(exc.errno, f"building the hub cache layout for {repo_id} from snapshot {snapshot.id}: "
                                     f"{exc.strerror}") from exc
    log.info("hub cache for %s built from snapshot %s (commit %s)", repo_id, snapshot.id, commit_of(snapshot))
    return final


def _build(store: Store, repo: Path, snapshot: Snapshot, commit: str, refs: tuple[str, ...]) -> None:
    """Hard links of the snapshot's files under `repo`, every directory opened without following a symlink."""
    files = repo / "snapshots" / commit
    with store.tree.held() as held, LinkTree(held.fd(files, create=True)) as links:
        for entry in snapshot.files:
            rel = validate_relpath(entry.path)  # from a manifest: validated again before it becomes a path
            src_fd = held.fd((snapshot.path / rel).parent)
            name = rel.rpartition("/")[2]
            if not stat.S_ISREG(os.stat(name, dir_fd=src_fd, follow_symlinks=False).st_mode):
                raise OSError(40, f"{snapshot.path / rel} is not a regular file; a snapshot holds nothing else "
                                  f"(run weightcache verify)")
            links.link(src_fd, name, rel)
        held.fd(repo / "refs", create=True)
        for ref in dict.fromkeys(refs):  # the hub writes the bare commit, no newline
            store.tree.write_atomic(repo / "refs" / ref, commit.encode(), mode=0o444, durable=False)
        for fd in links.made():  # deepest first, then the repo's own directories
            os.fchmod(fd, 0o555)
        for directory in (files, repo / "refs", repo / "snapshots", repo, repo.parent):
            os.fchmod(held.fd(directory), 0o555)


def prune(store: Store, *, unleased: bool = True) -> int:
    """Drop the views of snapshots the store no longer has (their hard links would keep evicted bytes on disk)
    and, with `unleased`, of snapshots nothing holds (no pod mounts a view without a lease; the next mount builds
    it again). Run on every build (evicted only) and by the daemon's reconcile pass (blocking: call it from a
    thread). Returns how many snapshots' views were removed."""
    base = store.root / HF_DIR
    with store.locked():
        names = [n for n in store.tree.listdir(base) if not n.startswith(".")]
        if not names:
            return 0
        live = {_safe(info.snapshot.id) for info in store.list()}
        held = set(store.leases().values()) if unleased else live
        gone = [n for n in names if n not in live or n not in held]
        for name in gone:
            store.tree.remove_tree(base / name)
    if gone:
        log.info("removed the hub cache views of %d snapshots evicted or no longer leased", len(gone))
    return len(gone)


def _safe(snapshot_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", snapshot_id):
        raise InvalidReferenceError(f"snapshot id {snapshot_id[:80]!r} is not a safe directory name")
    return snapshot_id
