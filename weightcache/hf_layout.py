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
snapshot id, stable across nodes. A tree is built once per (snapshot, repo) in a temporary directory and renamed
into place, so a partial tree is never visible. Trees of evicted snapshots are pruned on the next build and by
every reconcile pass of the daemon: until then their links keep the evicted bytes on disk (at most resyncSeconds).
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

from weightcache.errors import InvalidReferenceError
from weightcache.store import Snapshot, Store, tmp_name, validate_relpath

log = logging.getLogger(__name__)

HF_DIR = "hf"
COMMIT = re.compile(r"[0-9a-f]{40}")
# The hub's rule for repo ids (huggingface_hub.utils.validate_repo_id): an optional namespace, a name of at most
# 96 characters from [A-Za-z0-9._-], no "--" or ".." anywhere, not starting or ending with "-" or ".".
_PART = r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,94}[A-Za-z0-9])?"
REPO_ID = re.compile(rf"^(?:{_PART}/)?{_PART}$")
_REFS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")  # branch or tag names we write under refs/


def validate_repo_id(repo_id: str) -> str:
    """`org/name` as the hub accepts it; InvalidReferenceError says what is wrong."""
    if not REPO_ID.match(repo_id) or "--" in repo_id or ".." in repo_id:
        raise InvalidReferenceError(f"hfRepo {repo_id[:200]!r} is not a Hugging Face repo id such as "
                                    f"meta-llama/Llama-3.1-8B (letters, digits, '.', '_', '-'; no '--' or '..')")
    return repo_id


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
    thread). `refs` are extra names (the reference's branch or tag) that resolve to the snapshot besides main."""
    folder = repo_folder(repo_id)
    base = store.root / HF_DIR
    final = base / _safe(snapshot.id) / folder
    if final.is_dir() and not final.is_symlink():
        return final
    base.mkdir(mode=0o755, exist_ok=True)
    prune(store)
    parent = final.parent
    parent.mkdir(mode=0o755, exist_ok=True)
    tmp = tmp_name(final)
    try:
        _build(tmp / folder, snapshot, commit_of(snapshot), ("main", *[r for r in refs if _REFS.match(r)]))
        os.rename(tmp, final)  # atomic: readers see no tree or a whole one
    except FileExistsError:  # another thread built it first
        shutil.rmtree(tmp, ignore_errors=True)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():
            raise OSError(exc.errno, f"building the hub cache layout for {repo_id} from snapshot {snapshot.id}: "
                                     f"{exc.strerror}") from exc
    log.info("hub cache for %s built from snapshot %s (commit %s)", repo_id, snapshot.id, commit_of(snapshot))
    return final


def _build(repo: Path, snapshot: Snapshot, commit: str, refs: tuple[str, ...]) -> None:
    files = repo / "snapshots" / commit
    files.mkdir(parents=True)
    (repo / "refs").mkdir()
    for entry in snapshot.files:
        rel = validate_relpath(entry.path)  # from a manifest: validated again before it becomes a path
        source, target = snapshot.path / rel, files / rel
        if source.is_symlink():
            raise OSError(40, f"{source} is a symlink; a snapshot never holds one (run weightcache verify)")
        target.parent.mkdir(parents=True, exist_ok=True)
        os.link(source, target, follow_symlinks=False)
    for name in dict.fromkeys(refs):
        (repo / "refs" / name).write_text(commit)  # the hub writes the bare commit, no newline
        (repo / "refs" / name).chmod(0o444)
    for directory, _, _ in os.walk(repo, topdown=False):
        os.chmod(directory, 0o555)
    os.chmod(repo.parent, 0o555)


def prune(store: Store) -> int:
    """Drop the trees of snapshots the store no longer has: their hard links would keep evicted bytes on disk.
    Run on every build and by the daemon's reconcile pass (blocking: call it from a thread). Returns how many."""
    base = store.root / HF_DIR
    if not base.is_dir() or base.is_symlink():
        return 0
    live = {_safe(info.snapshot.id) for info in store.list()}
    gone = [entry for entry in base.iterdir() if entry.name not in live and not entry.name.startswith(".")]
    for entry in gone:
        _remove(entry)
    if gone:
        log.info("removed the hub cache layouts of %d evicted snapshots", len(gone))
    return len(gone)


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
        return
    for directory, _, _ in os.walk(path):
        os.chmod(directory, 0o755)  # our own read-only dirs: make them removable
    shutil.rmtree(path, ignore_errors=True)


def _safe(snapshot_id: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", snapshot_id):
        raise InvalidReferenceError(f"snapshot id {snapshot_id[:80]!r} is not a safe directory name")
    return snapshot_id
