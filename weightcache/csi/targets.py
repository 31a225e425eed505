"""Where a volume may be published: kubelet's directory for the pod's inline volume, reached without symlinks.

kubelet publishes an inline CSI volume at exactly

    <kubeletDir>/pods/<pod uid>/volumes/kubernetes.io~csi/<volume name>/mount

(kubelet's pkg/volume/csi: `getTargetPath`). Anything else, a `..` anywhere, or a component below kubeletDir that
is a symlink is refused (INVALID_ARGUMENT naming the rule): a request must not make the plugin mount over /etc or
follow a link planted in a pod directory. The walk opens each component relative to the last one with
O_PATH|O_NOFOLLOW|O_DIRECTORY, and the mount goes through the final directory's fd (/proc/self/fd/N), so a
component swapped for a symlink after the check changes nothing. kubeletDir itself comes from the operator
(config `kubeletDir`, env WEIGHTCACHE_KUBELET_DIR) and may be a symlink (some distributions move it).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from weightcache.errors import InvalidRequestError

RULE = "<kubeletDir>/pods/<pod uid>/volumes/kubernetes.io~csi/<volume name>/mount"
_WALK_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
_SHAPE = ("pods", None, "volumes", "kubernetes.io~csi", None, "mount")  # None: any single name


class TargetMissingError(FileNotFoundError):
    """A component of a (valid) target does not exist: there is nothing there to unpublish."""


class KubeletTargets:
    """Checks and opens target paths under one kubelet directory."""

    def __init__(self, kubelet_dir: str | Path) -> None:
        self.kubelet_dir = os.path.abspath(kubelet_dir)
        # kubelet may name the directory by its configured path or by where it really is
        self._prefixes = {self.kubelet_dir, os.path.realpath(self.kubelet_dir)}

    def check(self, target: str, field: str = "target_path") -> list[str]:
        """The components of `target` below kubeletDir (pods, uid, volumes, ...); lexical, no I/O."""
        for prefix in self._prefixes:
            if target.startswith(prefix.rstrip("/") + "/"):
                parts = target[len(prefix.rstrip("/")) + 1:].split("/")
                if len(parts) == len(_SHAPE) and all(
                        part == want if want is not None else part not in ("", ".", "..")
                        for part, want in zip(parts, _SHAPE, strict=True)):
                    return parts
        raise InvalidRequestError(field, f"{target!r} is not where kubelet publishes an inline volume: it must be "
                                  f"{RULE} with no '..' and no symlink (kubeletDir is {self.kubelet_dir}: set "
                                  "kubeletDir or WEIGHTCACHE_KUBELET_DIR if kubelet runs elsewhere)")

    @contextlib.contextmanager
    def open_parent(self, target: str, *, create: bool) -> Iterator[int]:
        """An O_PATH fd of the target's parent (`.../<volume name>`), walked from kubeletDir without following a
        symlink; missing directories are made (mode 0750) when `create`, else TargetMissingError."""
        parts = self.check(target)
        if create:  # kubelet made it long ago; a test or a fresh node may not have
            os.makedirs(self.kubelet_dir, mode=0o750, exist_ok=True)
        try:
            fd = os.open(self.kubelet_dir, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise TargetMissingError(errno.ENOENT, f"{self.kubelet_dir} does not exist") from None
        try:
            shown = self.kubelet_dir
            for part in parts[:-1]:
                shown = f"{shown}/{part}"
                child = open_dir(fd, part, shown, create=create)
                os.close(fd)
                fd = child
            yield fd
        finally:
            os.close(fd)


    def refuse_links(self, target: str) -> None:
        """Raise INVALID_ARGUMENT when a component of `target` that exists is a symlink (or a parent is not a
        directory), before anything is downloaded, leased or unmounted for it; missing components are fine."""
        with contextlib.suppress(TargetMissingError, FileNotFoundError), \
                self.open_parent(target, create=False) as parent:
            if stat.S_ISLNK(os.stat("mount", dir_fd=parent, follow_symlinks=False).st_mode):
                raise InvalidRequestError("target_path", f"{target} is a symlink; a target must be {RULE} with "
                                          "no symlink in it")


def open_dir(parent_fd: int, name: str, shown: str, *, create: bool) -> int:
    """O_PATH fd of directory `name` in `parent_fd`, never through a symlink; made (0750) when missing and
    `create`, else TargetMissingError."""
    try:
        return os.open(name, _WALK_FLAGS, dir_fd=parent_fd)
    except FileNotFoundError:
        if not create:
            raise TargetMissingError(errno.ENOENT, f"{shown} does not exist") from None
    except NotADirectoryError:
        kind = "a symlink" if stat.S_ISLNK(os.stat(name, dir_fd=parent_fd, follow_symlinks=False).st_mode) \
            else "not a directory"
        raise InvalidRequestError("target_path", f"{shown} is {kind}; a target must be {RULE} with no "
                                  "symlink in it") from None
    with contextlib.suppress(FileExistsError):  # made meanwhile by kubelet: open it all the same
        os.mkdir(name, 0o750, dir_fd=parent_fd)
    return open_dir(parent_fd, name, shown, create=False)
