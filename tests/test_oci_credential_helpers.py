"""Docker credential helpers for oci:// (`credHelpers`, `credsStore`): `docker-credential-<name> get` run with the
registry on stdin, its Username and Secret used for Basic auth against a real docker-registry with htpasswd.
The helper here is a script speaking the docker-credential-helpers protocol (what ECR's and GAR's helpers answer);
before, helpers were never run and the fetch was refused with "(none found)"."""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures_registry import Registry
from tests.grants import granted
from weightcache.errors import SourceAccessDeniedError
from weightcache.fetch import Fetcher
from weightcache.sources.registry import docker_credentials
from weightcache.store import Store

SECRET = "helper-s3cret-9d1e"


@pytest.fixture(scope="module")
def private(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = Registry.start(tmp_path_factory.mktemp("private"), auth=("alice", SECRET))
    reg.push("models/private:v1", {"config.json": b"{}", "w.bin": b"weights from a private registry"})
    yield reg
    reg.stop()


def helper(bin_dir: Path, name: str, answers: dict[str, dict[str, str]], log: Path) -> None:
    """docker-credential-<name>: `get` reads the server on stdin and prints its entry, or exits 1 (not found)."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / f"docker-credential-{name}"
    cases = "".join(f"  {json.dumps(k)}) echo '{json.dumps(v)}' ;;\n" for k, v in answers.items())
    script.write_text(f"""#!/bin/sh
[ "$1" = get ] || exit 2
read server
echo "$server" >> {log}
case "$server" in
{cases}  *) echo "credentials not found in native keychain"; exit 1 ;;
esac
""")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)


def config(directory: Path, doc: dict[str, object]) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(doc))
    return directory


@pytest.mark.parametrize("kind", ["credHelpers", "credsStore"])
def test_a_credential_helper_logs_in(private: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                     kind: str) -> None:
    asked = tmp_path / "asked"
    helper(tmp_path / "bin", "wctest", {private.host: {"ServerURL": private.host, "Username": "alice",
                                                       "Secret": SECRET}}, asked)
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    doc: dict[str, object] = ({"credHelpers": {private.host: "wctest"}} if kind == "credHelpers" else
                              {"credsStore": "wctest", "auths": {private.host: {}}})  # what `docker login` leaves
    monkeypatch.setenv("DOCKER_CONFIG", str(config(tmp_path / "docker", doc)))
    snap = Fetcher(Store(tmp_path / "root")).ensure(granted(f"oci://{private.host}/models/private:v1"))
    assert (snap.path / "w.bin").read_bytes() == b"weights from a private registry"
    assert asked.read_text().split() == [private.host]  # asked once per source, for this registry only


def test_a_helper_without_credentials_or_with_an_identity_token(private: Registry, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch,
                                                                caplog: pytest.LogCaptureFixture) -> None:
    helper(tmp_path / "bin", "wctest", {"token.example": {"Username": "<token>", "Secret": SECRET}},
           tmp_path / "asked")
    monkeypatch.setenv("PATH", f"{tmp_path / 'bin'}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("DOCKER_CONFIG", str(config(tmp_path / "docker", {"credsStore": "wctest"})))
    with pytest.raises(SourceAccessDeniedError, match="none found"):  # not found: asked without credentials
        Fetcher(Store(tmp_path / "root")).ensure(granted(f"oci://{private.host}/models/private:v1"))
    with caplog.at_level(logging.WARNING, logger="weightcache.sources.registry"):
        assert docker_credentials("token.example") is None
    assert "identity token" in caplog.text and SECRET not in caplog.text
    monkeypatch.setenv("DOCKER_CONFIG", str(config(tmp_path / "other", {"credHelpers": {"x.example": "../../sh"}})))
    with caplog.at_level(logging.WARNING, logger="weightcache.sources.registry"):
        assert docker_credentials("x.example") is None  # never a path: not a helper name
    monkeypatch.setenv("DOCKER_CONFIG", str(config(tmp_path / "gone", {"credsStore": "nosuchhelper"})))
    with caplog.at_level(logging.WARNING, logger="weightcache.sources.registry"):
        assert docker_credentials("x.example") is None
    assert "docker-credential-nosuchhelper is not on PATH" in caplog.text
