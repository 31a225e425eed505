"""What the CLI prints: the progress bar as a terminal shows it, `-o json` on every store command, per-command
`--help`, a repair that cannot reach its source, and a read-only store root."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.command import run_cli, weightcache
from tests.sample import make_model
from tests.test_cli import wc
from weightcache.cli import ProgressPrinter, build_parser
from weightcache.progress import Progress


class Terminal(io.StringIO):
    """A stream that says it is a terminal; `screen()` replays what was written the way a terminal draws it
    (`\\r` returns to column 0 without erasing, `ESC[K` erases to the end of the line, `\\n` ends the line)."""

    def isatty(self) -> bool:
        return True

    def screen(self) -> list[str]:
        lines, line, col = [], [], 0
        for token in re.findall(r"\x1b\[K|\r|\n|[^\r\n\x1b]", self.getvalue()):
            if token == "\r":
                col = 0
            elif token == "\n":
                lines.append("".join(line).rstrip())
                line, col = [], 0
            elif token == "\x1b[K":
                del line[col:]
            else:
                line[col:col + 1] = [token]
                col += 1
        return [*lines, "".join(line).rstrip()]


def _progress(phase: str, done: int, files: int = 1) -> Progress:
    return Progress(uri="s3://m/llama/", phase=phase, bytes_done=done, bytes_total=10 * 2**30, files_done=files,
                    files_total=12, rate=123.0 * 2**20, eta=40.0 if phase == "downloading" else None)


def test_progress_bar_redraw_leaves_nothing_of_a_longer_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    term = Terminal()
    printer = ProgressPrinter(term)
    draws = [_progress("downloading", 5 * 2**30, files=10), _progress("failed", 0), _progress("done", 10 * 2**30)]
    for p in draws:
        printer._last = 0.0  # every draw shown: the printer throttles by time
        printer(p)
        assert term.screen()[-1] == ProgressPrinter.bar(p), "the screen shows exactly the latest draw"
    printer.close()
    assert term.screen() == [ProgressPrinter.bar(draws[-1]), ""]
    assert "downloadingg" not in term.getvalue().replace("\x1b[K", "")


def test_progress_bar_is_cut_to_the_terminal_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")  # shutil.get_terminal_size reads it first
    term = Terminal()
    ProgressPrinter(term)(_progress("downloading", 2**30))
    assert len(term.screen()[-1]) <= 39, "a line that wraps cannot be redrawn with \\r"


@pytest.fixture
def cached(tmp_path: Path) -> tuple[Path, str, dict[str, object]]:
    make_model(tmp_path / "m", layers=1, hidden=64)
    model = f"file://{tmp_path / 'm'}/"
    root = tmp_path / "root"
    r = wc("prefetch", model, "-o", "json", root=root)
    assert r.returncode == 0, r.stderr
    return root, model, json.loads(r.stdout)


def test_every_store_command_prints_one_json_document(cached: tuple[Path, str, dict[str, object]],
                                                       capfd: pytest.CaptureFixture[str],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """In this process (cli.main; capfd reads file descriptor 1, so a stray write from any library shows too): ten
    commands as child processes cost ten interpreter starts, 9 of this test's 10 s on a loaded machine."""
    root, model, snap = cached
    monkeypatch.delenv("WEIGHTCACHE_SOCKET", raising=False)  # as wc: no daemon's socket
    commands = [["ls"], ["status"], ["verify"], ["gc"], ["pin", model], ["unpin", model], ["prefetch", model],
                ["prefetch", model, "--dry-run"], ["evict", "--to-size", "100Gi"], ["evict", model]]
    assert {c[0] for c in commands} == {a.dest for a in _store_commands()}, "a command without a json test"
    answers = {}
    for command in commands:
        code, out, err = run_cli(capfd, *command, "-o", "json", "--root", str(root))
        assert code == 0, (command, err)
        answers[" ".join(command[:1] + command[2:])] = json.loads(out)  # one document, nothing else
    assert answers["verify"]["damaged_left"] == 0 and answers["verify"]["snapshots"][0]["id"] == snap["id"]
    assert answers["gc"]["freed_bytes"] == 0 and answers["gc"]["evicted"] == []
    assert answers["pin"] == {"pinned": [snap["id"]]} and answers["unpin"] == {"unpinned": [snap["id"]]}
    assert answers["evict"] == {"evicted": [snap["id"]]}


def test_verify_json_reports_damage_with_exit_7(cached: tuple[Path, str, dict[str, object]]) -> None:
    root, _, snap = cached
    victim = Path(str(snap["path"])) / "config.json"
    os.chmod(victim, 0o644)
    victim.write_text('{"tampered": true}\n')
    r = wc("verify", "-o", "json", root=root)
    assert r.returncode == 7
    body = json.loads(r.stdout)
    assert body["damaged_left"] == 1 and body["snapshots"][0]["damaged"] == ["config.json"]


def test_failed_repair_keeps_the_damaged_snapshot_and_says_why(tmp_path: Path,
                                                               cached: tuple[Path, str, dict[str, object]]) -> None:
    root, _, snap = cached
    victim = Path(str(snap["path"])) / "config.json"
    os.chmod(victim, 0o644)
    victim.write_text('{"tampered": true}\n')
    shutil.move(tmp_path / "m", tmp_path / "moved")  # the source is gone: a refetch cannot succeed
    r = wc("verify", "--repair", root=root)
    assert r.returncode != 0
    assert "the damaged snapshot is kept" in r.stderr and "verify --repair" in r.stderr, r.stderr
    listed = json.loads(wc("ls", "-o", "json", root=root).stdout)
    assert [m["id"] for m in listed] == [snap["id"]], "the model must not vanish from ls"
    shutil.move(tmp_path / "moved", tmp_path / "m")  # following the message: fix the source, repair again
    r = wc("verify", "--repair", root=root)
    assert r.returncode == 0 and "repaired" in r.stdout, r.stdout + r.stderr


def _store_commands() -> list[object]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    # export: its -o json is tested against a registry (tests/test_export_oci.py); uninstall-node on a real node's
    # directories (tests/test_uninstall.py); engine-cache against a daemon (tests/test_engine_cache_cli.py)
    skipped = ("daemon", "webhook", "version", "export", "uninstall-node", "engine-cache")
    return [a for a in sub._choices_actions if a.dest not in skipped]  # type: ignore[attr-defined]


def _flags(command: str) -> set[str]:
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    parser = sub.choices[command]  # type: ignore[index]
    return {s for a in parser._actions for s in a.option_strings}


@pytest.mark.e2e
def test_each_command_shows_its_own_flags_only() -> None:
    prefetch_only = {"--concurrency", "--chunk-size", "--include", "--cluster", "--tier", "--disk-budget"}
    floor = {"--min-free-bytes", "--min-free-percent"}
    for command in ("ls", "status", "pin", "unpin", "evict", "verify", "gc"):
        assert not _flags(command) & prefetch_only, command
    for command in ("ls", "status", "pin", "unpin"):  # they never write bytes: no free-space floor
        assert not _flags(command) & floor, command
    for command in ("ls", "status"):  # nothing to quieten
        assert "--quiet" not in _flags(command)
    assert floor <= _flags("prefetch") and floor <= _flags("gc")
    r = weightcache("ls", "--help")
    assert r.returncode == 0 and "--min-free" not in r.stdout and "prefetch" not in r.stdout


@pytest.fixture
def read_only_root(tmp_path: Path, cached: tuple[Path, str, dict[str, object]]):  # type: ignore[no-untyped-def]
    """The cached store bind-mounted read-only (needs root, as mounts do)."""
    root, model, _ = cached
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "--bind", str(root), str(ro)], capture_output=True).returncode:
        pytest.skip("needs root to bind-mount a read-only store")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode:
            pytest.skip("cannot remount read-only here")
        yield ro, model
    finally:
        subprocess.run(["umount", str(ro)], check=False)


@pytest.mark.root
def test_read_only_root_names_the_fix(read_only_root: tuple[Path, str]) -> None:
    ro, model = read_only_root
    for command in (["prefetch", model], ["gc"], ["pin", model]):
        r = wc(*command, root=ro)
        assert r.returncode != 0, command
        assert "read-only filesystem" in r.stderr and "point --root" in r.stderr, (command, r.stderr)
        assert "[Errno 30]" not in r.stderr


def test_standalone_csi_server_takes_the_kubelet_dir_from_the_environment(monkeypatch: pytest.MonkeyPatch,
                                                                        tmp_path: Path) -> None:
    """Its own error says to set WEIGHTCACHE_KUBELET_DIR; the standalone server must then use it."""
    from weightcache.csi import server

    seen = {}

    async def record(args: object) -> None:  # stands in for serving: only the parsed flags matter here
        seen["kubelet_dir"] = args.kubelet_dir  # type: ignore[attr-defined]

    monkeypatch.setattr(server, "_main", record)
    monkeypatch.setenv("WEIGHTCACHE_KUBELET_DIR", str(tmp_path / "k3s-kubelet"))
    server.main(["--root", str(tmp_path / "root")])
    assert seen["kubelet_dir"] == str(tmp_path / "k3s-kubelet")
    server.main(["--root", str(tmp_path / "root"), "--kubelet-dir", "/flag/wins"])
    assert seen["kubelet_dir"] == "/flag/wins"
