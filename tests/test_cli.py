"""The `weightcache` command as a user runs it: a subprocess, real store, file:// model; output and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.command import weightcache
from tests.sample import make_model


def wc(*args: str, root: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "WEIGHTCACHE_SOCKET")}
    env["KUBECONFIG"] = "/nonexistent"
    return weightcache(*args, "--root", str(root), env=env)


@pytest.fixture
def model(tmp_path: Path) -> str:
    make_model(tmp_path / "m", layers=1, hidden=64)
    return f"file://{tmp_path / 'm'}/"


@pytest.mark.e2e
def test_prefetch_ls_pin_evict_cycle(tmp_path: Path, model: str) -> None:
    root = tmp_path / "root"
    r = wc("prefetch", model, "-o", "json", root=root)
    assert r.returncode == 0, r.stderr
    snap = json.loads(r.stdout)
    assert Path(snap["path"], "config.json").exists()
    progress = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    assert progress and progress[-1]["event"] == "progress", "non-terminal progress must be JSON lines"

    r = wc("ls", "-o", "json", root=root)
    assert [m["id"] for m in json.loads(r.stdout)] == [snap["id"]]
    r = wc("ls", root=root)
    assert "MODEL" in r.stdout and snap["id"][:12] in r.stdout

    assert wc("pin", model, root=root).returncode == 0
    r = wc("evict", model, root=root)
    assert r.returncode == 4 and "pinned by user" in r.stderr
    assert wc("unpin", model, root=root).returncode == 0
    r = wc("evict", model, root=root)
    assert r.returncode == 0, r.stderr
    assert json.loads(wc("ls", "-o", "json", root=root).stdout) == []


@pytest.mark.e2e
def test_bad_reference_exit_code_and_hint(tmp_path: Path) -> None:
    r = wc("prefetch", "s3:/models", root=tmp_path / "root")
    assert r.returncode == 2
    assert "write it like s3://" in r.stderr


@pytest.mark.e2e
def test_credentials_in_a_reference_never_echoed(tmp_path: Path) -> None:
    r = wc("prefetch", "https://alice:hunter2@example.com/m/", root=tmp_path / "root")
    assert r.returncode == 2
    assert "hunter2" not in r.stderr + r.stdout


@pytest.mark.e2e
def test_missing_model_exit_code(tmp_path: Path) -> None:
    r = wc("prefetch", f"file://{tmp_path}/nothing-here/", root=tmp_path / "root")
    assert r.returncode == 6, r.stderr
    r = wc("evict", "s3://models/never-fetched/", root=tmp_path / "root")
    assert r.returncode == 3 and "weightcache ls" in r.stderr


@pytest.mark.e2e
def test_verify_finds_damage_and_repair_refetches(tmp_path: Path, model: str) -> None:
    root = tmp_path / "root"
    snap = json.loads(wc("prefetch", model, "-o", "json", root=root).stdout)
    victim = Path(snap["path"]) / "config.json"
    os.chmod(victim, 0o644)
    victim.write_text('{"tampered": true}\n')
    r = wc("verify", root=root)
    assert r.returncode == 7 and "DAMAGED" in r.stdout and "config.json" in r.stdout
    r = wc("verify", "--repair", root=root)
    assert "repaired" in r.stdout, r.stdout + r.stderr
    r = wc("verify", root=root)
    assert r.returncode == 0 and "ok" in r.stdout


@pytest.mark.e2e
def test_evict_to_size_and_gc(tmp_path: Path, model: str) -> None:
    root = tmp_path / "root"
    assert wc("prefetch", model, root=root).returncode == 0
    r = wc("evict", "--to-size", "0", root=root)
    assert r.returncode == 0 and "evicted 1" in r.stdout
    assert wc("gc", root=root).returncode == 0
    assert not [p for p in (root / "blobs").rglob("*") if p.is_file()]
