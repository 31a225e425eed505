"""The `weightcache` command as a user runs it: a subprocess, real store, file:// model; output and exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.command import ROOT, weightcache
from tests.sample import make_model
from weightcache import cli


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


@pytest.mark.parametrize("argv", [
    ["prefetch", "s3://m/x/", "--concurrency", "4", "-q", "--include", "*.json"],
    ["--log-level", "DEBUG", "ls", "-o", "json"],
    ["--log-level=INFO", "evict", "--to-size", "1Gi"],
    ["--lo", "version", "ls"],  # the value of --log-level is "version"; the command is ls
    ["pin", "s3://m/x/"], ["unpin", "s3://m/x/"], ["verify", "--repair"], ["gc"], ["push", "s3://m/x/", "oci://r/m"],
    ["export", "s3://m/x/", "oci://r/m"], ["status"], ["engine-cache", "list"], ["uninstall-node", "--yes"],
    ["version", "-o", "json"],
])
def test_a_command_parsed_by_its_parser_alone_parses_as_by_all(argv: list[str]) -> None:
    """main builds the parser of the command argv names alone (argparse's construction of all of them was 7-14 ms
    of each start): the same flags, defaults and function as with every command's parser."""
    named = cli.command_named(argv)
    assert named is not None and named in argv
    alone, everyone = cli.build_parser(named), cli.build_parser()
    assert vars(alone.parse_args(argv)) == vars(everyone.parse_args(argv))
    assert "daemon" not in alone._subparsers._group_actions[0].choices  # type: ignore[union-attr]


@pytest.mark.parametrize("argv", [[], ["--help"], ["--version"], ["daemon"], ["webhook", "serve"], ["bogus"],
                                  ["--", "ls"], ["-q", "ls"]])
def test_a_command_not_named_plainly_gets_every_parser(argv: list[str]) -> None:
    assert cli.command_named(argv) is None


def test_the_command_leaves_with_its_output_and_its_atexit_handlers_run(tmp_path: Path) -> None:
    """`weightcache` leaves without the interpreter's teardown once only its thread is left (entry): what it
    printed and its exit code come out whole, after atexit handlers (logging's flush) ran."""
    code = ("import atexit, sys; atexit.register(lambda: print('atexit ran', file=sys.stderr)); "
            "from weightcache.cli import entry; sys.argv[0] = 'weightcache'; entry()")
    env = {**os.environ, "KUBECONFIG": "/nonexistent"}
    ok = subprocess.run([sys.executable, "-c", code, "ls", "-o", "json", "--root", str(tmp_path / "root")],
                        capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert (ok.returncode, json.loads(ok.stdout), ok.stderr) == (0, [], "atexit ran\n")
    bad = subprocess.run([sys.executable, "-c", code, "prefetch", "s3:/models", "--root", str(tmp_path / "root")],
                         capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert bad.returncode == 2 and bad.stderr.endswith("atexit ran\n") and "write it like s3://" in bad.stderr


@pytest.mark.parametrize("argv", [
    ["prefetch", "s3://m/x/", "--conc", "4"],  # an abbreviation of a flag the settings declare
    ["prefetch", "s3://m/x/", "--read-timeout=5"],
    ["prefetch", "-qo", "json", "s3://m/x/"],  # a cluster of short flags
    ["prefetch", "s3://m/x/", "-q", "--socket", "/s"],
])
def test_a_prefetch_parses_as_with_its_fetch_flags_declared_first(argv: list[str]) -> None:
    """The prefetch parser declares the fetch settings' flags only where the command line may name one
    (cli.CommandParser `skippable`): every given flag parses to the same value as with them declared first."""
    declared = cli.build_parser("prefetch")
    declared._subparsers._group_actions[0].choices["prefetch"]._declared()  # type: ignore[union-attr]
    got, want = vars(cli.build_parser("prefetch").parse_args(argv)), vars(declared.parse_args(argv))
    assert {k: v for k, v in want.items() if k in got or v is not None} == got


def test_a_prefetch_usage_error_lists_the_fetch_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """A usage error prints every flag of the command, those of the settings too, though none was given."""
    with pytest.raises(SystemExit):
        cli.build_parser("prefetch").parse_args(["prefetch", "-q"])
    assert "[--concurrency CONCURRENCY]" in " ".join(capsys.readouterr().err.split())
