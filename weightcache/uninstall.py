"""`weightcache uninstall-node`: remove what weightcache left on this node (docs/operations.md "Uninstalling").

What it removes: the store (`--root`, with the CSI volume records and DRA claim records inside it), the CSI and
DRA plugin sockets and their kubelet registration sockets (`--kubelet-dir`), the DRA driver's CDI spec files
(`--cdi-dir`, `models.weightcache.io-*.json` only), the daemon's socket directory (`--run-dir`), and, when a cluster
config is found, this node's readiness labels (`weightcache.io/m<20 hex>`). Without `--yes` it only says what it
would remove.

It refuses (InUseError, nothing removed) while a lease is held (a pod's volume or a DRA claim uses a snapshot),
naming the holders, and while the node daemon still answers on its socket, unless `--force`; it never removes a
directory that does not look like a store, nor anything under a mount point.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from weightcache.errors import ClusterError, ConfigError, InUseError
from weightcache.store.holders import describe_holder
from weightcache.store.layout import Layout
from weightcache.uri import is_readiness_label
from weightcache.vocabulary import CSI_DRIVER, DRA_DRIVER

if TYPE_CHECKING:
    from weightcache.kube.client import ApiClient

STORE_MARKERS = ("index.db", "blobs", "snapshots", "manifests", "refs", "leases")
DAEMON_SOCKET = "weightcache.sock"


@dataclass(frozen=True)
class Item:
    path: str
    what: str


@dataclass
class Report:
    removed: list[Item] = field(default_factory=list)  # or, in a dry run, what would be
    node: str | None = None
    labels: list[str] = field(default_factory=list)
    applied: bool = False  # False: a dry run (no --yes)
    notes: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        key = "removed" if self.applied else "wouldRemove"
        return {key: [{"path": i.path, "what": i.what} for i in self.removed],
                "node": self.node, "labels" if self.applied else "wouldRemoveLabels": self.labels,
                "applied": self.applied, "notes": self.notes}


def plan(root: Path, kubelet_dir: Path, cdi_dir: Path, run_dir: Path) -> list[Item]:
    """What exists of weightcache's on this node (nothing is removed here)."""
    items: list[Item] = []
    if root.exists() and not (root.is_dir() and not any(root.iterdir())):  # an empty directory: nothing there
        if not looks_like_store(root):
            raise ConfigError(f"{root} does not look like a weightcache store (none of {', '.join(STORE_MARKERS)}); "
                              f"check --root")
        items.append(Item(str(root), "the model store (snapshots, blobs, index, leases, CSI and DRA records)"))
    for driver, what in ((CSI_DRIVER, "CSI"), (DRA_DRIVER, "DRA")):
        plugin = kubelet_dir / "plugins" / driver
        if plugin.exists() or plugin.is_symlink():
            items.append(Item(str(plugin), f"the {what} plugin's socket directory"))
        reg = kubelet_dir / "plugins_registry" / f"{driver}-reg.sock"
        if reg.exists() or reg.is_symlink():
            items.append(Item(str(reg), f"the {what} plugin's kubelet registration socket"))
    if cdi_dir.is_dir():
        for spec in sorted(cdi_dir.glob(f"{DRA_DRIVER}-*.json")):
            items.append(Item(str(spec), "a CDI spec of the DRA driver"))
    if run_dir.exists() and (run_dir / DAEMON_SOCKET).exists():
        items.append(Item(str(run_dir), "the daemon's socket directory"))
    return items


def looks_like_store(root: Path) -> bool:
    return root.is_dir() and root.resolve() != Path("/") and any((root / m).exists() for m in STORE_MARKERS)


def holders(root: Path) -> list[str]:
    """Who holds a lease in the store at `root`, in words (empty when none or no store)."""
    leases = Layout(root).leases
    if not leases.is_dir():
        return []
    names = sorted(p for p in leases.iterdir() if not p.name.startswith("."))
    return [describe_holder(root, Layout.holder_of(p)) for p in names]


def uninstall(root: Path, kubelet_dir: Path, cdi_dir: Path, run_dir: Path, *, yes: bool, force: bool = False,
              api_client: ApiClient | None = None, node: str | None = None) -> Report:
    """Remove (with `yes`) or list what weightcache left on this node; see the module docstring."""
    report = Report(removed=plan(root, kubelet_dir, cdi_dir, run_dir), node=node, applied=yes)
    in_use = holders(root) if root.is_dir() else []
    if in_use and not force:
        raise InUseError(f"the store {root} is in use: {'; '.join(in_use)}. Delete those pods (or claims) first, "
                         f"or pass --force to remove it anyway (their mounts then lose their files)")
    if in_use:
        report.notes.append(f"removed while in use (--force): {'; '.join(in_use)}")
    live = [s for s in (run_dir / DAEMON_SOCKET, kubelet_dir / "plugins" / CSI_DRIVER / "csi.sock") if _answers(s)]
    if live and not force:
        raise InUseError(f"the weightcache node plugin still runs here ({live[0]} answers); delete the "
                         f"weightcache-node DaemonSet first (docs/operations.md, Uninstalling), or pass --force")
    for item in report.removed:
        _check_no_mounts(Path(item.path))
    if api_client is not None and node:
        report.labels = _readiness_labels(api_client, node)
    if not yes:
        report.notes.append("nothing removed: run again with --yes")
        return report
    for item in report.removed:
        _remove(Path(item.path))
    if report.labels:
        _unlabel(api_client, node or "", report.labels)
    return report


def _answers(path: Path) -> bool:
    if not path.exists():
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(0.5)
        try:
            s.connect(str(path))
        except OSError:
            return False
        return True


def _check_no_mounts(path: Path) -> None:
    if not path.is_dir() or path.is_symlink():
        return
    for top, dirs, _files in os.walk(path):
        for d in dirs:
            inner = os.path.join(top, d)
            if os.path.ismount(inner):
                raise InUseError(f"{inner} is a mount point; unmount it first (a pod's volume still published?)")


def _remove(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        return
    if os.path.ismount(path):  # a hostPath of the uninstall DaemonSet: empty it, the node keeps the directory
        for child in path.iterdir():
            _remove(child)
        return
    shutil.rmtree(path, onerror=_writable_and_retry)


def _writable_and_retry(func: Callable[..., Any], path: str, _exc: Any) -> None:
    """Snapshot directories are 0555: make the parent writable (and the entry, for a directory) and retry."""
    parent = os.path.dirname(path)
    os.chmod(parent, stat.S_IMODE(os.lstat(parent).st_mode) | stat.S_IWUSR | stat.S_IXUSR)
    if os.path.isdir(path) and not os.path.islink(path):
        os.chmod(path, stat.S_IMODE(os.lstat(path).st_mode) | stat.S_IRWXU)
    func(path)


def _readiness_labels(api_client: ApiClient, node: str) -> list[str]:
    from weightcache.kube.client import ApiException, CoreV1Api

    try:
        obj = CoreV1Api(api_client).read_node(node)
    except ApiException as exc:
        raise ClusterError(f"reading node {node}: {exc.status} {exc.reason}; set NODE_NAME to this node's name",
                           status=exc.status) from exc
    return sorted(k for k in (obj.metadata.labels or {}) if is_readiness_label(k))


def _unlabel(api_client: ApiClient, node: str, labels: list[str]) -> None:
    from weightcache.kube.client import ApiException, CoreV1Api

    try:
        CoreV1Api(api_client).patch_node(node, {"metadata": {"labels": dict.fromkeys(labels)}})
    except ApiException as exc:
        raise ClusterError(f"removing the readiness labels of node {node}: {exc.status} {exc.reason}",
                           status=exc.status) from exc
