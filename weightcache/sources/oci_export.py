"""`weightcache export`: a cached snapshot pushed to a registry as a ModelPack artifact (docs/sources.md, "Export").

    export_snapshot(snapshot, parse_ref("oci://registry/repo:tag")) -> Exported(digest, ...)

The artifact: an OCI image manifest with `artifactType` `application/vnd.cncf.model.manifest.v1+json`, a config
blob `application/vnd.cncf.model.config.v1+json` (ModelPack v1's `descriptor`, `config`, `modelfs`), and one raw
layer per file (`application/vnd.cncf.model.{weight,weight.config,doc,code}.v1.raw`) annotated with
`org.cncf.model.filepath` (and `org.opencontainers.image.title`, so `oras pull` writes the same tree). `oci://`
reads it back (sources/oci.py).

Blobs go up with the distribution API: `HEAD /v2/<repo>/blobs/<digest>` skips a blob the registry has, else
`POST /v2/<repo>/blobs/uploads/` and one `PUT ...?digest=` (files up to MONOLITHIC_MAX) or `PATCH` chunks of
CHUNK bytes and a closing `PUT`. The registry checks each digest against the bytes it got; the manifest goes last
(`PUT /v2/<repo>/manifests/<tag>`), so a reader never sees a tag naming missing blobs. Auth, plain HTTP for
loopback registries and redirects are the source's (sources/registry.py). Every answer is untrusted: a Location
is bounded and kept on the registry's scheme, the manifest digest the registry reports is compared with our own.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from weightcache.errors import IntegrityError, InvalidReferenceError, SourceError
from weightcache.sources.base import SourceOptions
from weightcache.sources.registry import NETWORK_ERRORS, RegistryClient
from weightcache.store import Snapshot
from weightcache.uri import OCI_DIGEST, ModelRef

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
ARTIFACT_TYPE = "application/vnd.cncf.model.manifest.v1+json"
CONFIG_TYPE = "application/vnd.cncf.model.config.v1+json"
FILEPATH = "org.cncf.model.filepath"
TITLE = "org.opencontainers.image.title"
MONOLITHIC_MAX = 32 << 20  # files up to this size go up in one PUT
CHUNK = 32 << 20  # bytes of one PATCH of a chunked upload
LOCATION_MAX = 8192

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ggml", ".onnx", ".h5", ".msgpack", ".ckpt",
                   ".pb", ".tflite", ".npz", ".model.bin")
DOC_SUFFIXES = (".md", ".rst", ".txt.md", ".pdf")
DOC_NAMES = ("license", "licence", "notice", "readme", "copying", "use_policy")
CODE_SUFFIXES = (".py", ".sh", ".ipynb", ".js", ".cu", ".cpp", ".c", ".h")
FORMATS = {".safetensors": "safetensors", ".gguf": "gguf", ".onnx": "onnx", ".pt": "pytorch", ".pth": "pytorch",
           ".bin": "pytorch", ".h5": "tensorflow", ".pb": "tensorflow"}


@dataclass(frozen=True)
class Exported:
    """What `export_snapshot` pushed: the manifest's digest, and blobs uploaded or already there."""

    target: str  # oci://registry/repo:tag
    digest: str  # sha256:... of the manifest's bytes, as we computed them
    files: int
    size: int  # bytes of the files
    uploaded: int  # blobs sent (config included)
    skipped: int  # blobs the registry already had (HEAD 200)


def media_type(relpath: str) -> str:
    """The ModelPack layer media type of a file: weights, docs, code, else a weight's config (tokenizer, config)."""
    name = relpath.rsplit("/", 1)[-1].lower()
    if name.endswith(WEIGHT_SUFFIXES) or (name.startswith(("model-", "pytorch_model")) and "." not in name[6:]):
        kind = "weight"
    elif name.endswith(DOC_SUFFIXES) or name.split(".", 1)[0] in DOC_NAMES:
        kind = "doc"
    elif name.endswith(CODE_SUFFIXES):
        kind = "code"
    else:
        kind = "weight.config"
    return f"application/vnd.cncf.model.{kind}.v1.raw"


def model_config(snapshot: Snapshot, target: ModelRef, created: str) -> dict[str, Any]:
    """The ModelPack config (v1): `descriptor` (name, createdAt, revision), `config.format` when the weights say,
    `modelfs` (type `layers`, `diff_ids`: for raw layers the blobs' own digests, in layer order)."""
    descriptor: dict[str, Any] = {"name": target.prefix.strip("/").rsplit("/", 1)[-1], "createdAt": created}
    if snapshot.revision:
        descriptor["revision"] = snapshot.revision
    formats = {FORMATS[s] for f in snapshot.files for s in FORMATS if f.path.lower().endswith(s)}
    config: dict[str, Any] = {"format": formats.pop()} if len(formats) == 1 else {}
    return {"descriptor": descriptor, "config": config,
            "modelfs": {"type": "layers", "diff_ids": [f"sha256:{f.sha256}" for f in _files(snapshot)]}}


def export_snapshot(snapshot: Snapshot, target: ModelRef, options: SourceOptions | None = None, *,
                    on_file: Callable[[str, bool], None] | None = None) -> Exported:
    """Push `snapshot` to `target` (oci://registry/repo[:tag], default tag latest) as a ModelPack artifact.
    `on_file(relpath, uploaded)` after each file's blob is in the registry."""
    if target.scheme != "oci":
        raise InvalidReferenceError(f"export pushes to an oci:// reference, not {target.uri}")
    tag = target.revision or "latest"
    if OCI_DIGEST.fullmatch(tag):
        raise InvalidReferenceError(f"export pushes to a tag, not a digest: oci://{target.bucket}/"
                                    f"{target.prefix.strip('/')}:TAG (the digest is the manifest's, printed after)")
    if target.include or target.exclude:
        raise InvalidReferenceError("export pushes every file of the snapshot; drop include/exclude")
    opts = options or SourceOptions()
    client = RegistryClient(target.bucket, target.prefix.strip("/"), opts)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    try:
        pusher = _Pusher(client, opts)
        layers = []
        for f in _files(snapshot):
            sent = pusher.blob(f"sha256:{f.sha256}", f.size, snapshot.path / f.path, f.path)
            layers.append({"mediaType": media_type(f.path), "digest": f"sha256:{f.sha256}", "size": f.size,
                           "annotations": {FILEPATH: f.path, TITLE: f.path}})
            if on_file is not None:
                on_file(f.path, sent)
        config = json.dumps(model_config(snapshot, target, created), sort_keys=True).encode()
        config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
        pusher.blob(config_digest, len(config), config, "the ModelPack config")
        manifest = {"schemaVersion": 2, "mediaType": OCI_MANIFEST, "artifactType": ARTIFACT_TYPE,
                    "config": {"mediaType": CONFIG_TYPE, "digest": config_digest, "size": len(config)},
                    "layers": layers, "annotations": {"org.opencontainers.image.created": created}}
        digest = pusher.manifest(tag, json.dumps(manifest, sort_keys=True).encode())
    finally:
        client.close()
    return Exported(f"oci://{target.bucket}/{target.prefix.strip('/')}:{tag}", digest, len(snapshot.files),
                    snapshot.size, pusher.uploaded, pusher.skipped)


def _files(snapshot: Snapshot) -> list[Any]:
    return sorted(snapshot.files, key=lambda f: f.path)


class _Pusher:
    def __init__(self, client: RegistryClient, options: SourceOptions) -> None:
        self.client, self.options = client, options
        self.uploaded = self.skipped = 0

    def blob(self, digest: str, size: int, data: Path | bytes, what: str) -> bool:
        """Make `digest` a blob of the repository: True when we uploaded it, False when the registry had it."""
        if self.options.retry(f"HEAD the blob of {what}").call(lambda: self._has(digest, size, what)):
            self.skipped += 1
            return False
        self.options.retry(f"upload {what}").call(lambda: self._upload(digest, size, data, what))
        self.uploaded += 1
        return True

    def _has(self, digest: str, size: int, what: str) -> bool:
        resp = self.client.request("HEAD", f"{self.client.base}blobs/{digest}", what, ok=(200, 404))
        _done(resp)
        if resp.status == 404:
            return False
        length = str(resp.headers.get("Content-Length", ""))
        if length.isdigit() and int(length) != size:  # another blob under our digest: not ours to trust
            raise IntegrityError(f"{what}: the registry's blob {digest} is {length[:20]} bytes, ours {size}")
        return True

    def _upload(self, digest: str, size: int, data: Path | bytes, what: str) -> None:
        """One whole upload session (started over by the retry on a network failure)."""
        resp = self.client.request("POST", f"{self.client.base}blobs/uploads/", what, headers={"Content-Length": "0"},
                                   ok=(202,))
        location = self._location(resp, what)
        if size <= MONOLITHIC_MAX:
            body = data if isinstance(data, bytes) else _read(data, 0, size, what)
            self._close_upload(location, digest, body, what)
            return
        assert isinstance(data, Path)
        pos = 0
        while pos < size:
            chunk = _read(data, pos, min(CHUNK, size - pos), what)
            resp = self.client.request(
                "PATCH", location, what, body=chunk, ok=(202,),
                headers={"Content-Type": "application/octet-stream", "Content-Length": str(len(chunk)),
                         "Content-Range": f"{pos}-{pos + len(chunk) - 1}"})
            location = self._location(resp, what)
            pos += len(chunk)
        self._close_upload(location, digest, b"", what)

    def _close_upload(self, location: str, digest: str, body: bytes, what: str) -> None:
        sep = "&" if "?" in location else "?"
        resp = self.client.request("PUT", f"{location}{sep}digest={digest}", what, body=body, ok=(201, 204),
                                   headers={"Content-Type": "application/octet-stream",
                                            "Content-Length": str(len(body))})
        _done(resp)

    def _location(self, resp: Any, what: str) -> str:
        location = str(resp.headers.get("Location", ""))
        _done(resp)
        if not location or len(location) > LOCATION_MAX:
            raise SourceError(f"{what}: the registry's upload answer has no usable Location")
        return self.client.url(location)

    def manifest(self, tag: str, body: bytes) -> str:
        digest = "sha256:" + hashlib.sha256(body).hexdigest()

        def put() -> Any:
            return self.client.request("PUT", f"{self.client.base}manifests/{tag}", f"the manifest {tag}", body=body,
                                       headers={"Content-Type": OCI_MANIFEST}, ok=(201, 200))

        resp = self.options.retry(f"PUT the manifest {tag}").call(put)
        _done(resp)
        said = str(resp.headers.get("Docker-Content-Digest", ""))
        if said and said != digest:
            raise IntegrityError(f"the registry stored the manifest {tag} as {said[:80]}, its bytes hash to {digest}")
        return digest


def _read(path: Path, offset: int, length: int, what: str) -> bytes:
    """Bytes of a snapshot file (the store's own, hashed when fetched; the registry checks them again)."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise SourceError(f"{what}: the cached file is shorter than its manifest says ({len(data)} of {length} "
                          "bytes from its offset); run `weightcache verify`")
    return data


def _done(resp: Any) -> None:
    """Drain and release a response whose body we do not need."""
    with suppress(*NETWORK_ERRORS):
        resp.drain_conn()
    resp.release_conn()


__all__ = ["Exported", "export_snapshot", "media_type", "model_config"]
