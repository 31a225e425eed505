"""Every error we raise on purpose declares its own answer at every boundary: exit code, HTTP status, gRPC code.

The walk covers subclasses defined anywhere in the package, including ones added later, so a new error cannot
fall through to "unexpected" (exit 1, HTTP 500, gRPC INTERNAL) by omission.
"""

from __future__ import annotations

import http
import importlib
import importlib.util
import pkgutil
import re
from pathlib import Path

import grpc
import pytest

import weightcache
from weightcache import errors
from weightcache.csi.errors import code_for

ROOT = Path(__file__).resolve().parents[1]


def _import_package() -> None:
    """Import every module, so errors defined outside errors.py are subclasses by the time we walk."""
    for info in pkgutil.walk_packages(weightcache.__path__, "weightcache."):
        if "._pb" not in info.name and info.name != "weightcache.__main__":
            importlib.import_module(info.name)


def _subclasses(cls: type[errors.WeightcacheError]) -> list[type[errors.WeightcacheError]]:
    found: list[type[errors.WeightcacheError]] = []
    for sub in cls.__subclasses__():
        found += [sub, *_subclasses(sub)]
    return sorted(set(found), key=lambda c: f"{c.__module__}.{c.__qualname__}")


_import_package()
ALL = _subclasses(errors.WeightcacheError)


def _instance(cls: type[BaseException]) -> BaseException:
    return cls.__new__(cls)  # without __init__: some take (key, reason) or (field, message)


def test_the_walk_finds_errors_in_and_outside_errors_py() -> None:
    from weightcache.store import BlobMissingError

    assert {errors.NotCachedError, errors.SourceNotFoundError, BlobMissingError} <= set(ALL) and len(ALL) >= 30


@pytest.mark.parametrize("cls", ALL, ids=lambda c: c.__name__)
def test_every_error_declares_its_own_answer(cls: type[errors.WeightcacheError]) -> None:
    assert "answer" in vars(cls), f"{cls.__name__}: declare `answer = Answer(exit code, HTTP status, gRPC code)`"
    exit_code, status, code = cls.answer
    assert exit_code in (1, 2, 3, 4, 5, 6, 7, 8, 9, 130)
    assert 400 <= http.HTTPStatus(status) < 600
    assert code in grpc.StatusCode.__members__ and code != "OK"
    assert errors.answer_for(_instance(cls)) == cls.answer


def test_anything_else_is_unexpected() -> None:
    unexpected = errors.Answer(1, 500, "INTERNAL")
    assert errors.answer_for(RuntimeError("x")) == errors.answer_for(errors.WeightcacheError("x")) == unexpected


def test_the_boundaries_use_the_answers(tmp_path: Path) -> None:
    from weightcache.cli import main
    from weightcache.daemon.api import error_body

    assert code_for(_instance(errors.InUseError)) is grpc.StatusCode.FAILED_PRECONDITION
    assert code_for(NotImplementedError()) is grpc.StatusCode.UNIMPLEMENTED
    assert code_for(KeyError("x")) is grpc.StatusCode.INTERNAL
    assert error_body(KeyError("secret detail"))["message"].startswith("internal error")
    assert error_body(errors.NotCachedError("s3://m/x/ is not cached")) == {
        "error": "not_cached", "message": "s3://m/x/ is not cached"}
    assert main(["evict", "s3://models/never-fetched/", "--root", str(tmp_path / "root")]) == 3


def test_every_exit_code_is_documented() -> None:
    codes = {cls.answer.exit_code for cls in ALL} | {0}
    for doc in (errors.__doc__ or "", (ROOT / "README.md").read_text()):
        listed = {int(n) for n in re.findall(r"\b(\d{1,3})\s+(?:ok|unexpected|bad|not|in use|no space|object|integrity|"
                                              r"refused|still|interrupted)", doc)}
        assert codes <= listed, f"undocumented exit codes {sorted(codes - listed)}"


@pytest.mark.parametrize("cls", [errors.StoreError, errors.InUseError, errors.NotCachedError])
def test_store_errors_are_not_os_errors(cls: type[BaseException]) -> None:
    """An `except OSError` around file work must not swallow 'not cached' or 'in use'."""
    assert not issubclass(cls, OSError)


def test_csi_doc_table_lists_exactly_the_codes_the_plugin_answers() -> None:
    text = (ROOT / "docs" / "csi.md").read_text()
    documented = set(re.findall(r"^\| ([A-Z_]{5,}) \|", text, re.MULTILINE))
    answered = {cls.answer.grpc_code for cls in ALL} | {"UNIMPLEMENTED", "INTERNAL"}
    assert documented == answered, (f"docs/csi.md's error table lacks {sorted(answered - documented)} "
                                    f"and lists {sorted(documented - answered)} that nothing answers")


@pytest.mark.parametrize(("uri", "package"), [("gs://bucket/model/", "gcsfs"), ("az://container/model/", "adlfs")])
def test_a_missing_optional_backend_exits_2_with_the_pip_install(
        uri: str, package: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec(package) is not None:
        pytest.skip(f"{package} is installed here")
    from weightcache.cli import main

    assert main(["prefetch", uri, "--root", str(tmp_path / "root")]) == 2
    assert f"pip install {package}" in capsys.readouterr().err


def test_docs_errors_md_is_the_table_the_code_declares() -> None:
    text = (ROOT / "docs" / "errors.md").read_text()
    rows = re.findall(r"^\| `(\w+)` \| (\d+) \| (\d+) \| ([A-Z_]+) \|", text, re.MULTILINE)
    documented = {name: errors.Answer(int(code), int(status), grpc_code) for name, code, status, grpc_code in rows}
    declared = {cls.__name__: cls.answer for cls in ALL}
    differ = sorted(set(documented.items()) ^ set(declared.items()))
    assert not differ, f"docs/errors.md and weightcache/errors.py differ: {differ}"
