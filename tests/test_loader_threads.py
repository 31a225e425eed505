"""The loader's read-ahead threads: none when the model is in the page cache, else at most one per usable CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

from weightcache import loader  # noqa: E402


def _model(tmp_path: Path, mb: int = 8) -> Path:
    path = tmp_path / "model.safetensors"
    safetensors_torch.save_file({"w": torch.arange(mb << 18, dtype=torch.float32)}, str(path))
    return path


def _evict(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def test_cached_model_is_not_read_ahead(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _model(tmp_path)
    path.read_bytes()  # every page in the page cache
    files = loader._open_files(loader._layout(path), None)
    assert loader._read_threads(files) == 0
    monkeypatch.setattr(loader, "_cached_pages", lambda *_: None)  # a kernel without cachestat: mincore answers
    assert loader._read_threads(files) == 0
    monkeypatch.undo()
    state = loader.load_state_dict(path)
    assert torch.equal(state["w"], torch.arange(8 << 18, dtype=torch.float32))


def test_cold_model_reads_on_at_most_one_thread_per_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _model(tmp_path)
    _evict(path)
    files = loader._open_files(loader._layout(path), None)
    if all(loader._resident(f) for f in files):
        pytest.skip("this filesystem keeps the pages (tmpfs): nothing is cold here")
    monkeypatch.setattr(loader, "_usable_cpus", lambda: 2)
    assert loader._read_threads(files) == 2
    monkeypatch.setattr(loader, "_usable_cpus", lambda: 64)
    assert loader._read_threads(files) == loader.READ_THREADS
    state = loader.load_state_dict(path)
    assert torch.equal(state["w"], torch.arange(8 << 18, dtype=torch.float32))


def test_usable_cpus_follows_the_cgroup_quota(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    real_open = open
    quota = tmp_path / "cpu.max"

    def fake_open(file: object, *args: object, **kwargs: object) -> object:
        return real_open(quota if file == "/sys/fs/cgroup/cpu.max" else file, *args, **kwargs)  # type: ignore

    monkeypatch.setattr("builtins.open", fake_open)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    quota.write_text("150000 100000\n")
    assert loader._usable_cpus() == 2
    quota.write_text("max 100000\n")
    assert loader._usable_cpus() == 8
    quota.write_text("garbage\n")
    assert loader._usable_cpus() == 8
