"""The one way tests run the `weightcache` command: `weightcache(...)` as a user runs it (a child process of this
interpreter, output captured), `start_weightcache(...)` the same left running, `run_cli(...)` in this process
(`cli.main`, so a stand-in's state and the test's environment are shared).

    proc = weightcache("ls", "--root", str(root))                 # CompletedProcess: returncode, stdout, stderr
    proc = start_weightcache("daemon", ..., stderr=subprocess.PIPE)  # Popen: still running
    code, out, err = run_cli(capsys, "status", "-o", "json")     # capsys or capfd
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from weightcache import cli

ROOT = Path(__file__).resolve().parent.parent  # the checkout: its weightcache is the one under test


def weightcache(*args: str, env: Mapping[str, str] | None = None,
                timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """`weightcache ARGS` in a child process, run from the checkout; `env` replaces the environment (None: this
    process's)."""
    return subprocess.run([sys.executable, "-m", "weightcache", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=None if env is None else dict(env))


def start_weightcache(*args: str, env: Mapping[str, str] | None = None, **popen: Any) -> subprocess.Popen[str]:
    """`weightcache ARGS` started as `weightcache` does it, left running: `popen` says where its output goes (and
    e.g. `preexec_fn`)."""
    return subprocess.Popen([sys.executable, "-m", "weightcache", *args], text=True, cwd=ROOT,
                            env=None if env is None else dict(env), **popen)


def run_cli(capture: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """`cli.main(argv)` here: its exit code and what this command alone wrote to stdout and stderr."""
    capture.readouterr()
    code = cli.main(list(argv))
    out, err = capture.readouterr()
    return code, out, err
