"""A real OCI registry for tests: the CNCF distribution registry (Debian's `docker-registry`, /usr/bin) on
127.0.0.1 with a free port and its storage in a temp dir, artifacts pushed by the real `oras` SDK.

    reg = Registry.start(tmp_path)                        # plain HTTP, no auth; reg.stop() at the end
    def test_x(registry: Registry): ...                  # the fixture: one registry per test module
    digest = reg.push("models/tiny:v1", {"config.json": b"{}", "model.safetensors": data})   # ModelPack layers
    reg.blob_file(layer_digest).write_bytes(b"...")       # damage a blob behind the registry's back
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

BINARY = "/usr/bin/docker-registry"
RAW = "application/vnd.cncf.model.weight.v1.raw"
MODEL_CONFIG = "application/vnd.cncf.model.config.v1+json"
MODEL_ARTIFACT = "application/vnd.cncf.model.manifest.v1+json"
FILEPATH = "org.cncf.model.filepath"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def htpasswd_line(user: str, password: str) -> str:
    import bcrypt

    return f"{user}:{bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()}\n"


@dataclass
class Registry:
    root: Path
    port: int
    proc: subprocess.Popen[bytes]
    auth: tuple[str, str] | None = None

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    @classmethod
    def start(cls, tmp: Path, *, auth: tuple[str, str] | None = None) -> Registry:
        if not os.access(BINARY, os.X_OK):
            pytest.skip(f"{BINARY} missing: apt-get install docker-registry (scripts/_venv.sh does as root)")
        tmp.mkdir(parents=True, exist_ok=True)
        port = free_port()
        lines = ["version: 0.1", "log:", "  level: error", "  accesslog:", "    disabled: true", "storage:",
                 "  filesystem:", f"    rootdirectory: {tmp / 'storage'}", "  delete:", "    enabled: true",
                 "http:", f"  addr: 127.0.0.1:{port}", "  secret: weightcache-test"]
        if auth is not None:
            (tmp / "htpasswd").write_text(htpasswd_line(*auth))
            lines += ["auth:", "  htpasswd:", "    realm: weightcache-test", f"    path: {tmp / 'htpasswd'}"]
        (tmp / "config.yml").write_text("\n".join(lines) + "\n")
        log = (tmp / "registry.log").open("wb")
        proc = subprocess.Popen([BINARY, "serve", str(tmp / "config.yml")], stdout=log, stderr=subprocess.STDOUT)
        reg = cls(tmp / "storage", port, proc, auth)
        deadline = time.monotonic() + 20
        while True:
            try:
                urllib.request.urlopen(f"http://{reg.host}/v2/", timeout=1).close()
                break
            except urllib.error.HTTPError as exc:
                if exc.code == 401:
                    break
            except OSError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                reg.stop()
                raise RuntimeError(f"docker-registry did not start: {(tmp / 'registry.log').read_text()[-2000:]}")
            time.sleep(0.05)
        return reg

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    # -- pushing ------------------------------------------------------------------------------------------------
    def client(self) -> Any:
        import oras.client  # type: ignore[import-untyped]

        client = oras.client.OrasClient(hostname=self.host, insecure=True,
                                        auth_backend="basic" if self.auth else "token")
        if self.auth:
            client.auth.set_basic_auth(*self.auth)
        return client

    def push(self, target: str, files: dict[str, bytes], *, media_type: str = RAW, annotation: str | None = FILEPATH,
             modelpack: bool = True, work: Path | None = None, media_types: dict[str, str] | None = None,
             layer_annotations: dict[str, dict[str, str]] | None = None) -> str:
        """Push `files` (relpath -> bytes) as one layer each with oras; returns the manifest's digest.
        `media_types` / `layer_annotations`: a layer's own, by relpath (a tar layer beside raw files)."""
        work = work or self.root.parent / f"push-{hashlib.sha256(target.encode()).hexdigest()[:8]}-{time.time_ns()}"
        work.mkdir(parents=True)
        annotations: dict[str, dict[str, str]] = {}
        paths = []
        for i, (relpath, data) in enumerate(files.items()):
            path = work / f"f{i}-{relpath.rsplit('/', 1)[-1]}"
            path.write_bytes(data)
            paths.append(f"{path}:{(media_types or {}).get(relpath, media_type)}")
            if annotation:
                annotations[str(path)] = {annotation: relpath}
            annotations.setdefault(str(path), {}).update((layer_annotations or {}).get(relpath, {}))
            if annotation != "org.opencontainers.image.title":  # oras names the layer by basename; set ours
                annotations.setdefault(str(path), {})["org.opencontainers.image.title"] = path.name
        config = work / "config.json"
        config.write_text(json.dumps({"descriptor": {"name": "tiny"}}))
        (work / "annotations.json").write_text(json.dumps(annotations))
        resp = self.client().push(
            target=f"{self.host}/{target}", files=paths, disable_path_validation=True,
            annotation_file=str(work / "annotations.json"),
            manifest_config=f"{config}:{MODEL_CONFIG}" if modelpack else None, quiet=True)
        shutil.rmtree(work)
        return str(resp.headers["Docker-Content-Digest"])

    def put_blob(self, repo: str, data: bytes) -> str:
        """Upload raw bytes as a blob (monolithic POST + PUT); returns its digest."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        loc = self._call("POST", f"/v2/{repo}/blobs/uploads/", b"", {}).headers["Location"]
        sep = "&" if "?" in loc else "?"
        self._call("PUT", f"{loc}{sep}digest={digest}", data, {"Content-Type": "application/octet-stream"})
        return digest

    def put_manifest(self, repo: str, reference: str, doc: dict[str, Any] | bytes, media_type: str) -> str:
        body = doc if isinstance(doc, bytes) else json.dumps(doc).encode()
        self._call("PUT", f"/v2/{repo}/manifests/{reference}", body, {"Content-Type": media_type})
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def manifest(self, repo: str, reference: str) -> dict[str, Any]:
        accept = "application/vnd.oci.image.manifest.v1+json, application/vnd.oci.image.index.v1+json"
        return dict(json.loads(self._call("GET", f"/v2/{repo}/manifests/{reference}", None,
                                          {"Accept": accept}).read()))

    def _call(self, method: str, path: str, body: bytes | None, headers: dict[str, str]) -> Any:
        import base64

        url = path if path.startswith("http") else f"http://{self.host}{path}"
        req = urllib.request.Request(url, data=body, method=method, headers=headers)
        if self.auth:
            req.add_header("Authorization", "Basic " + base64.b64encode(":".join(self.auth).encode()).decode())
        return urllib.request.urlopen(req, timeout=30)

    def blob_file(self, digest: str) -> Path:
        """The file the registry serves a blob from (filesystem driver layout)."""
        hexdigest = digest.partition(":")[2]
        return self.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """One registry for a test module (its tests use repositories and bytes of their own)."""
    reg = Registry.start(tmp_path_factory.mktemp("registry"))
    yield reg
    reg.stop()


@pytest.fixture(autouse=True)
def no_docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Never the developer's own docker credentials (autouse: every test)."""
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "no-docker-config"))


def docker_config(directory: Path, registry: str, user: str, password: str, *, name: str = "config.json") -> Path:
    """A docker config file with `auths` for `registry` (what `docker login` writes)."""
    import base64

    directory.mkdir(parents=True, exist_ok=True)
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    (directory / name).write_text(json.dumps({"auths": {registry: {"auth": auth}}}))
    return directory
