"""A source's optional capabilities are declared on `sources.base.Source` with no-op defaults, and the engine calls
them on every source: a `getattr(source, ...)`/`hasattr(source, ...)` probe, an `isinstance(..., PeerSource)`
check or `inspect.signature` of an engine is a contract mypy cannot check (docs/architecture.md)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import weightcache
from weightcache.peers.source import PeerSource
from weightcache.sources import BACKENDS, Source

PACKAGE = Path(weightcache.__file__).parent
_PROBES = ("getattr", "hasattr")


def probes(source: str) -> list[tuple[int, str]]:
    """(line, call) of each capability probe in `source`: getattr/hasattr of anything named like a source (or
    the peer wrapper's origin), isinstance against PeerSource, inspect.signature."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call) or not node.args:
            continue
        call, first = ast.unparse(node.func), ast.unparse(node.args[0])
        probe = (call in _PROBES and ("source" in first.lower() or "origin" in first.lower())) \
            or (call == "isinstance" and "PeerSource" in ast.unparse(node.args[-1])) \
            or call in ("inspect.signature", "signature")
        if probe:
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_finds_each_kind_of_probe() -> None:
    source = ("a = getattr(source, 'local', False)\nb = hasattr(self.origin, 'expand')\n"
              "c = isinstance(src, PeerSource)\nd = inspect.signature(ensure)\ne = getattr(resp, '_fp', None)\n")
    assert [line for line, _ in probes(source)] == [1, 2, 3, 4]


def test_no_capability_probe_in_the_package() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text}"
             for path in sorted(PACKAGE.rglob("*.py")) if "_pb" not in path.parts
             for line, text in probes(path.read_text())]
    assert not found, "declare the capability on sources.base.Source (or fetch_queue.Engine):\n" + "\n".join(found)


def test_every_backend_and_the_peer_wrapper_inherit_the_defaults() -> None:
    """A backend that only looks like a Source would lack the defaults the engine calls (AttributeError on the
    first cache hit or download): each subclasses it."""
    classes = {getattr(importlib.import_module(target.partition(":")[0]), target.partition(":")[2])
               for target, package in BACKENDS.values() if package is None or importlib.util.find_spec(package)}
    assert all(Source in cls.__mro__ for cls in [*classes, PeerSource]), classes
