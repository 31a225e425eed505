"""Names shared across layers are defined once, in weightcache/vocabulary.py (docs/architecture.md): a
`"weightcache.io/...` string literal anywhere else in the package is a second definition that can drift."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import weightcache

PACKAGE = Path(weightcache.__file__).parent
_LITERAL = re.compile(r"""^[rbuRBUfF]*(['"]{1,3})weightcache\.io/""")  # a string (or f-string) that starts so


def literals(source: str) -> list[tuple[int, str]]:
    """(line, token) of each string literal in `source` that starts with `weightcache.io/`, docstrings aside
    (they may say a key's name in prose)."""
    tree = ast.parse(source)
    docstrings = {node.body[0].value.lineno for node in ast.walk(tree)
                  if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                  and node.body and isinstance(node.body[0], ast.Expr)
                  and isinstance(node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str)}
    return [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
            if tok.type == tokenize.STRING and _LITERAL.match(tok.string) and tok.start[0] not in docstrings]


def test_the_scan_finds_a_literal_and_passes_a_docstring() -> None:
    source = '"""weightcache.io/model in prose."""\nKEY = "weightcache.io/model"\nMSG = f"weightcache.io/{1}"\n'
    assert [line for line, _ in literals(source)] == [2, 3]


def test_no_weightcache_io_literal_outside_the_vocabulary() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}: {text[:60]}"
             for path in sorted(PACKAGE.rglob("*.py"))
             if path.name != "vocabulary.py" and "_pb" not in path.parts
             for line, text in literals(path.read_text())]
    assert not found, "define these in weightcache/vocabulary.py and import them:\n" + "\n".join(found)
