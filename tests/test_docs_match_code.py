"""Docs say what the code does: the defaults docs/config.md and the CLI's help print are the code's defaults."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest
import yaml

from weightcache import defaults
from weightcache.daemon.config import Settings, parse_settings, value_of
from weightcache.units import parse_size

DOCS = Path(__file__).resolve().parents[1] / "docs"
# | `field` | env | flag | `default` ... | applies | meaning |: the rows whose default is a literal value
ROWS = re.findall(r"^\| `(\w+)` \|[^|\n]*\|[^|\n]*\| `([^`]*)`[^|\n]*\|", (DOCS / "config.md").read_text(),
                  re.MULTILINE)
SPECIAL = {"allowUndeclaredModels"}  # its default depends on where the daemon runs; the row says both


def test_the_table_was_read() -> None:
    assert {"root", "chunkSize", "concurrency", "socket", "kubeletDir"} <= {key for key, _ in ROWS}


@pytest.mark.parametrize(("key", "documented"), [r for r in ROWS if r[0] not in SPECIAL], ids=lambda v: str(v))
def test_documented_defaults_are_the_code_defaults(key: str, documented: str) -> None:
    parsed = parse_settings({key: yaml.safe_load(documented)})
    assert value_of(parsed, key) == value_of(Settings(), key), f"docs/config.md: {key} default"


def test_cli_help_states_the_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    from weightcache.cli import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(["prefetch", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert f"default {defaults.ROOT}" in text and f"default {defaults.SOCKET}" in text
    assert f"(default {defaults.CONCURRENCY})" in text
    chunk = re.search(r"--chunk-size CHUNK_SIZE [^\[]*?\(default (\w+)\)", text)
    assert chunk and parse_size(chunk.group(1)) == defaults.CHUNK_SIZE


def _parser_flags() -> set[str]:
    from weightcache.cli import build_parser

    flags: set[str] = set()
    parsers = [build_parser()]
    while parsers:
        parser = parsers.pop()
        parser.format_help()  # as `--help` shows them: the daemon declares its flags (the settings' own) only then
        for action in parser._actions:
            flags.update(o for o in action.option_strings if o.startswith("--"))
            if isinstance(action, argparse._SubParsersAction):
                parsers += action.choices.values()
    return flags


def _documented_commands() -> list[str]:
    """`weightcache ...` as the docs write it: in inline code, and as lines of code blocks (continuations joined)."""
    text = "\n".join(p.read_text() for p in [DOCS.parent / "README.md", *sorted(DOCS.glob("*.md"))])
    commands = re.findall(r"`(weightcache [^`]+)`", text)
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL):
        joined = block.replace("\\\n", " ")
        commands += [line.strip() for line in joined.splitlines() if line.strip().startswith("weightcache ")]
    return commands


def test_documented_cli_flags_exist() -> None:
    commands = _documented_commands()
    assert len(commands) >= 10
    flags = _parser_flags()
    unknown = {(flag, cmd) for cmd in commands for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cmd)
               if flag not in flags}
    assert not unknown, f"docs show flags the CLI does not have: {sorted(unknown)}"


def test_the_house_plan_names_every_top_level_module() -> None:
    """docs/architecture.md places each module and package of weightcache in a layer (lint-imports checks them)."""
    import weightcache

    plan = (DOCS / "architecture.md").read_text()
    root = Path(weightcache.__file__).parent
    names = {p.stem for p in root.glob("*.py") if p.stem != "__init__"}
    names |= {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}
    missing = sorted(n for n in names if f"`{n}" not in plan)
    assert not missing, f"docs/architecture.md does not place {missing}"
