"""oci:// models: ModelPack and ORAS artifacts in an OCI registry (the distribution API).

    oci://registry[:port]/repository:tag          the tag is resolved at every listing
    oci://registry[:port]/repository@sha256:<hex>  pinned: the manifest's bytes must hash to the digest

The listing is the manifest (an OCI image manifest or a Docker v2 one; from an OCI index or a Docker manifest
list the linux/amd64 entry, or the only entry of an artifact's index). Each layer is one file, named by its
file-path annotation: ModelPack's `org.cncf.model.filepath` (and the earlier `org.cnai.model.filepath`), else
ORAS's `org.opencontainers.image.title`; the name is checked like every key (`store.paths.validate_relpath`).
Raw layers are files. A tar layer (ModelPack's `*.tar`, `*.tar+gzip`; an ORAS directory with
`io.deis.oras.content.unpack`) is listed as one hidden object, `.weightcache/layers/<hex digest>`, that the engine
downloads and verifies like any file; `expand` then replaces it by its members (sources/oci_tar.py), each a blob
of its own, so a member is used only once the whole layer hashed to its digest. `*.tar+zstd` is refused at
listing: no zstd decoder is a dependency (docs/sources.md, "Tar layers").

Blobs are read by ranged GETs (`GET /v2/<repo>/blobs/<digest>`, redirects followed without credentials to other
hosts), so the engine's parallel, resumable, verified download applies. Every layer's digest checks the bytes
downloaded (a claim, `claimed_sha256`) and is never evidence for linking a blob unread or asking peers, even when
the reference pins the manifest by digest: the pin proves which manifest, not that its layers are the bytes they
name (docs/peers.md, "What counts as evidence"). A blob already on the node is reused only on this node's own
record of downloading the same layer of the same repository.

Everything the registry sends is untrusted: sizes, digests, counts, media types, annotations, token answers.
Credentials come from a docker config file (`$DOCKER_CONFIG/config.json`, a mounted pull secret's
`.dockerconfigjson`, else `~/.docker/config.json`): Basic, or the Bearer token a `WWW-Authenticate` challenge
names. A registry on a loopback address is plain HTTP (as container runtimes treat localhost); other plain-HTTP
registries are listed in `WEIGHTCACHE_OCI_INSECURE_REGISTRIES` (host or host:port, comma-separated).
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import logging
import re
from typing import TYPE_CHECKING, Any

import urllib3

from weightcache.errors import (
    HostileKeyError,
    IntegrityError,
    SourceError,
    WeightcacheError,
)
from weightcache.sources.base import (
    ObjectInfo,
    OnBytes,
    Pieces,
    Retryable,
    Source,
    SourceOptions,
    finish_listing,
    origin_pieces,
    read_body_into,
    read_range_into,
)
from weightcache.sources.http import read_capped
from weightcache.sources.oci_tar import COMPRESSIONS, HIDDEN, expand_layers, member_name
from weightcache.sources.registry import INSECURE_ENV, RegistryClient, docker_credentials, plain_http
from weightcache.store.paths import validate_relpath
from weightcache.units import ascii_int
from weightcache.uri import OCI_DIGEST, ModelRef

if TYPE_CHECKING:
    from weightcache.store import FileEntry, Snapshot, Store

log = logging.getLogger(__name__)

MANIFEST_MAX = 4 << 20  # bytes of one manifest or index (the distribution registry's own limit)
MAX_LAYERS = 10_000  # files of one artifact (a bigger model belongs in tar layers)
MAX_INDEX = 1_000  # entries of one index
MAX_BLOB = (1 << 63) - 1

OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
OCI_INDEX = "application/vnd.oci.image.index.v1+json"
DOCKER_MANIFEST = "application/vnd.docker.distribution.manifest.v2+json"
DOCKER_LIST = "application/vnd.docker.distribution.manifest.list.v2+json"
MANIFESTS = (OCI_MANIFEST, DOCKER_MANIFEST)
INDEXES = (OCI_INDEX, DOCKER_LIST)
ACCEPT = ", ".join((*MANIFESTS, *INDEXES))

#: file-path annotations, the first present names the file
FILEPATH_ANNOTATIONS = ("org.cncf.model.filepath", "org.cnai.model.filepath", "org.opencontainers.image.title")
ORAS_UNPACK = "io.deis.oras.content.unpack"
_MODEL_NS = re.compile(r"^application/vnd\.(?:cncf|cnai)\.model\.")
_MODEL_LAYER = re.compile(r"^application/vnd\.(?:cncf|cnai)\.model\.(?:weight|weight\.config|config|doc|code|dataset)"
                          r"\.v1\.(raw|tar|tar\+gzip|tar\+zstd)$")
_MODEL_CONFIG = re.compile(r"^application/vnd\.(?:cncf|cnai)\.model\.config\.v1\+json$")
_MODEL_ARTIFACT = re.compile(r"^application/vnd\.(?:cncf|cnai)\.model\.manifest\.v1\+json$")
#: RFC 6838 type/subtype
_MEDIA_TYPE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}$")


class OciSource(Source):
    """A registry artifact's layers as files; ranged blob reads with the registry's auth."""

    name = "oci"
    resolves_revision = True  # @tag or @digest is the registry's; the listing is that manifest's layers

    def __init__(self, ref: ModelRef, options: SourceOptions | None = None) -> None:
        self.ref = ref
        self.options = o = options or SourceOptions()
        self.registry = ref.bucket
        self.repository = ref.prefix.strip("/")
        self.client = RegistryClient(self.registry, self.repository, o)
        self.scheme, self.base = self.client.scheme, self.client.base
        self.trusted = False  # the listing's manifest was pinned by digest and hashed to it
        self.tars: dict[str, tuple[str, str]] = {}  # the listing's tar layers: hex digest -> (name, compression)

    def __repr__(self) -> str:
        return f"OciSource({str(self.ref)!r})"

    # -- the Source interface ---------------------------------------------------------------------------------
    def list(self) -> builtins.list[ObjectInfo]:
        manifest, trusted = self._resolve()
        objects = self._objects(manifest, trusted)
        self.trusted = trusted
        hint = f"the artifact {self.ref} has no file layers"
        tars = [o for o in objects if o.relpath.startswith(HIDDEN)]
        if not tars:
            return finish_listing(self.ref, objects, hint=hint)
        # a tar layer's members are not known before it is read: the globs select them in expand
        files = [o for o in objects if not o.relpath.startswith(HIDDEN) and self.ref.matches(o.relpath)]
        return sorted(files + tars, key=lambda o: o.relpath)

    def expand(self, entries: builtins.list[FileEntry], store: Store) -> builtins.list[FileEntry]:
        """The fetch engine's hook between download and publish (fetch/engine.py `_fetch_once`): each downloaded tar
        layer replaced by its members passing the globs, written as blobs of `store`; `entries` itself when the
        listing had no tar layer."""
        if not any(e.path.startswith(HIDDEN) for e in entries):
            return entries
        return expand_layers(entries, self.tars, store, key=self.ref.key, uri=self.ref.uri, keep=self.ref.matches)

    def claimed_sha256(self, obj: ObjectInfo) -> str | None:
        """The layer's digest: the registry's content address, a claim that checks the downloaded bytes."""
        return obj.etag

    def read_into(self, obj: ObjectInfo, offset: int, buf: memoryview) -> None:
        read_range_into(self.options, obj.relpath, obj, offset, buf,
                        lambda pos, view: read_body_into(self._open_range(obj, pos, pos + len(view)), view))

    def read_pieces(self, obj: ObjectInfo, offset: int, length: int, buf: memoryview,
                    on_bytes: OnBytes | None = None) -> Pieces:
        return origin_pieces(self.options, obj.key, lambda pos, end: self._open_range(obj, pos, end), offset, length,
                             buf, on_bytes)

    def etag_md5(self, obj: ObjectInfo) -> str | None:
        return None

    def still_names(self, snapshot: Snapshot) -> bool:
        """Whether this reference still names `snapshot`'s files (the engine's veto of a cache hit, fetch/engine.py
        `Fetcher._still_named`). A digest always does. A tag is resolved again (its manifest, through any index:
        a GET of a few KB) and its file layers compared with the snapshot's by path, size and layer digest: a
        moved tag misses, and the engine fetches what it names now. A registry that cannot answer (down, tag
        gone, credentials refused) leaves the cached snapshot served, with a warning: an outage of the registry
        must not take models off nodes that hold them."""
        if self.ref.revision and OCI_DIGEST.fullmatch(self.ref.revision):
            return True
        self.options = dataclasses.replace(self.options, max_attempts=min(2, self.options.max_attempts))
        self.client.options = self.options
        try:
            listed = self.list()
        except (WeightcacheError, Retryable) as exc:
            log.warning("%s: cannot tell whether the tag moved (%s); serving the cached snapshot %s", self.ref,
                        str(exc)[:300], snapshot.id[:12])
            return True
        # a tar layer's members carry the layer's digest as their etag (a raw file's etag is its own sha256)
        files = {(f.path, f.size, f.etag) for f in snapshot.files if f.etag == f.sha256}
        layers = {f.etag for f in snapshot.files if f.etag != f.sha256}
        tars = {o.etag for o in listed if o.relpath.startswith(HIDDEN)}
        # under globs a layer may give no file, so it may be in the listing and not in the snapshot
        same_tars = layers == tars or (bool(self.ref.include or self.ref.exclude) and layers <= tars)
        return same_tars and {(o.relpath, o.size, o.etag) for o in listed if not o.relpath.startswith(HIDDEN)} == files

    def close(self) -> None:
        self.client.close()

    # -- manifests --------------------------------------------------------------------------------------------
    def _resolve(self) -> tuple[dict[str, Any], bool]:
        """The image manifest the reference names (through an index), and whether it is pinned: the reference
        is a digest and every manifest on the way hashed to the digest that named it."""
        reference = self.ref.revision or "latest"
        pinned = bool(OCI_DIGEST.fullmatch(reference))
        body, header_type = self._manifest(reference, reference if pinned else None)
        doc = _json_object(body, f"the manifest of {self.ref}")
        media_type = _media_type_of(doc, header_type, str(self.ref))
        if media_type in INDEXES:
            entry = _pick(doc, str(self.ref))
            body, header_type = self._manifest(entry["digest"], entry["digest"], entry["size"])
            doc = _json_object(body, f"the manifest {entry['digest']} of {self.ref}")
            media_type = _media_type_of(doc, header_type, str(self.ref))
            if media_type not in MANIFESTS:
                raise SourceError(f"{self.ref}: the index names a {media_type[:100]!r}, not an image manifest")
        return doc, pinned

    def _manifest(self, reference: str, digest: str | None, size: int | None = None) -> tuple[bytes, str]:
        """One manifest's bytes (at most MANIFEST_MAX) and Content-Type; `digest`: they must hash to it."""
        url = f"{self.base}manifests/{reference}"

        def get() -> tuple[bytes, str]:
            resp = self._request(url, {"Accept": ACCEPT}, f"the manifest {reference[:80]}")
            body = read_capped(resp, MANIFEST_MAX, f"the manifest {reference[:80]}")
            return body, str(resp.headers.get("Content-Type", "")).split(";")[0].strip()

        body, content_type = self.options.retry(f"GET the manifest of {self.ref}").call(get)
        if len(body) > MANIFEST_MAX:
            raise SourceError(f"{self.ref}: the manifest {reference[:80]} is over {MANIFEST_MAX >> 20} MiB")
        if digest is not None:
            got = "sha256:" + hashlib.sha256(body).hexdigest()
            if got != digest:
                raise IntegrityError(f"{self.ref}: the manifest {digest} the registry sent hashes to {got}")
            if size is not None and size != len(body):
                raise IntegrityError(f"{self.ref}: the manifest {digest} is {len(body)} bytes, its index says {size}")
        return body, content_type

    def _objects(self, manifest: dict[str, Any], trusted: bool) -> builtins.list[ObjectInfo]:
        """One ObjectInfo per file layer; every field checked before it is used."""
        layers = manifest.get("layers")
        if not isinstance(layers, builtins.list):
            raise SourceError(f"{self.ref}: the manifest has no list of layers")
        if len(layers) > MAX_LAYERS:
            raise HostileKeyError(f"{self.ref} layer {MAX_LAYERS}", f"the artifact has {len(layers)} layers, "
                                  f"more than {MAX_LAYERS}; pack its small files into fewer layers")
        config = manifest.get("config")
        config_type = config.get("mediaType") if isinstance(config, dict) else None
        artifact_type = manifest.get("artifactType")
        modelpack = any(isinstance(t, str) and (_MODEL_CONFIG.fullmatch(t) or _MODEL_ARTIFACT.fullmatch(t))
                        for t in (config_type, artifact_type))
        names: set[str] = set()
        self.tars = {}
        return [self._object(i, raw, modelpack, names) for i, raw in enumerate(layers)]

    def _object(self, i: int, raw: Any, modelpack: bool, names: set[str]) -> ObjectInfo:
        """The file (or hidden tar object, kept in `tars`) of layer `i`; `names`: the paths of the layers before."""
        layer = _descriptor(raw, f"{self.ref} layer {i}")
        media_type, annotations = layer["mediaType"], layer["annotations"]
        what = f"{self.ref} layer {i} ({media_type})"
        name = next((annotations[a] for a in FILEPATH_ANNOTATIONS if annotations.get(a)), None)
        if name is None:
            raise SourceError(f"{what} names no file (no {' / '.join(FILEPATH_ANNOTATIONS)} annotation): "
                              "not a ModelPack or ORAS artifact")
        model = _MODEL_LAYER.fullmatch(media_type)
        compression = _tar_compression(media_type, model.group(1) if model else None,
                                       annotations.get(ORAS_UNPACK, "").lower() == "true" or
                                       _oras_py_directory(media_type, name))
        # a directory's tar layer may be named `weights/` or `./weights` (its members say the rest)
        relpath = validate_relpath(name if compression is None else member_name(name))
        if relpath.split("/", 1)[0] == HIDDEN.split("/", 1)[0]:
            raise HostileKeyError(relpath, f"names the store's own directory {HIDDEN.split('/', 1)[0]!r}")
        if relpath in names:
            raise HostileKeyError(relpath, f"named by two layers of {self.ref}")
        names.add(relpath)
        if not model and (_MODEL_NS.match(media_type) or modelpack):
            raise SourceError(f"{what}: unknown media type for a ModelPack layer {media_type[:100]!r}; known: "
                              "application/vnd.cncf.model.{weight,weight.config,config,doc,code,dataset}"
                              ".v1.{raw,tar,tar+gzip,tar+zstd} (and vnd.cnai.model.*)")
        hexdigest = layer["digest"].partition(":")[2]
        if compression is not None:
            if compression not in COMPRESSIONS:
                raise SourceError(f"{what} for {relpath!r} is {compression}, which this build does not unpack: "
                                  f"push it as {' or '.join(COMPRESSIONS)}, or each file as its own raw layer")
            if hexdigest in self.tars:
                raise HostileKeyError(relpath, f"is a tar layer of {self.ref} that another layer is too")
            self.tars[hexdigest] = (relpath, compression)
            relpath = HIDDEN + hexdigest
        # never evidence (checksum None), even under a pinned manifest: the registry (or whoever wrote the
        # manifest the tenant pinned) names any digest it likes, and linking one unread would hand it another
        # tenant's blob; the digest checks the bytes downloaded (claimed_sha256), as the hub's lfs.sha256 does
        return ObjectInfo(f"{self.base}blobs/{layer['digest']}", relpath, layer["size"], hexdigest, None, None)

    # -- HTTP -------------------------------------------------------------------------------------------------
    def _open_range(self, obj: ObjectInfo, pos: int, end: int) -> Any:
        """GET bytes [pos, end) of the blob: the checked response, body unread. A blob of another size than the
        manifest's is an integrity failure (the bytes do not match what the manifest addressed)."""
        resp = self._request(obj.key, {"Range": f"bytes={pos}-{end - 1}", "Accept-Encoding": "identity"},
                             obj.relpath, ok=(200, 206, 416))
        total: int | None
        if resp.status == 416:
            resp.close()
            raise IntegrityError(f"{obj.relpath}: the registry's blob {obj.etag} is shorter than the {obj.size} "
                                 "bytes its manifest says")
        if resp.status == 200:
            total = ascii_int(str(resp.headers.get("Content-Length", "")))
            if pos != 0:
                resp.close()
                raise SourceError(f"{obj.relpath}: HTTP 200 to a range request; the registry must serve ranges")
        else:
            start, _, rest = str(resp.headers.get("Content-Range", "")).removeprefix("bytes ").partition("-")
            total = ascii_int(rest.partition("/")[2])
            if ascii_int(start) != pos:
                resp.close()
                raise SourceError(f"{obj.relpath}: the registry answered a range request with another range")
        if total is not None and total != obj.size:
            resp.close()
            raise IntegrityError(f"{obj.relpath}: the registry's blob {obj.etag} is {total} bytes, its manifest says "
                                 f"{obj.size}")
        if isinstance(resp, urllib3.HTTPResponse):
            resp.enforce_content_length = False  # a short body returns what came; we count and resume from there
        return resp

    def _request(self, url: str, headers: dict[str, str], what: str, ok: tuple[int, ...] = (200,)) -> Any:
        """GET `url` through the registry client (auth, redirects, errors); the checked response, body unread."""
        return self.client.request("GET", url, what, headers=headers, ok=ok)



#: oras-py pushes a directory as one gzipped tar of this media type, titled with the directory's name and without
#: ORAS_UNPACK, and unpacks every layer of this type on pull (oras/provider.py `pull`); oras (Go) unpacks only
#: with the annotation, and names a file it pushes `...v1.tar`. A layer of this type titled like a directory (no
#: archive suffix) is therefore a directory, unpacked as oras-py does; one titled `x.tar.gz` stays a file.
ORAS_PY_DIRECTORY = "application/vnd.oci.image.layer.v1.tar+gzip"
_ARCHIVE_SUFFIXES = (".tar.gz", ".tgz", ".gz", ".tar", ".zip", ".tar+gzip")


def _oras_py_directory(media_type: str, title: str) -> bool:
    return media_type == ORAS_PY_DIRECTORY and not title.lower().endswith(_ARCHIVE_SUFFIXES)


def _tar_compression(media_type: str, modelpack: str | None, oras_unpack: bool) -> str | None:
    """A tar layer's compression (None: a raw file). ModelPack says it in the media type; an ORAS directory is
    gzip (as oras writes and reads it) unless its media type ends in `.tar` (or says zstd)."""
    if modelpack is not None:
        return None if modelpack == "raw" else modelpack
    if not oras_unpack:
        return None
    if media_type.endswith(("+zstd", ".zstd")):
        return "tar+zstd"
    return "tar" if media_type.endswith(".tar") else "tar+gzip"


# -- registry documents ----------------------------------------------------------------------------------------
def _json_object(body: bytes, what: str) -> dict[str, Any]:
    """A JSON object; a key repeated at any level is refused (two parsers could read two different manifests)."""
    def pairs(items: builtins.list[tuple[str, Any]]) -> dict[str, Any]:
        out = dict(items)
        if len(out) != len(items):
            raise ValueError("a key repeated")
        return out

    try:
        doc = json.loads(body, object_pairs_hook=pairs)
    except (ValueError, RecursionError) as exc:
        raise SourceError(f"{what} is not valid JSON ({str(exc)[:80]})") from None
    if not isinstance(doc, dict):
        raise SourceError(f"{what} is not a JSON object")
    return doc


def _media_type_of(doc: dict[str, Any], header: str, what: str) -> str:
    media_type = doc.get("mediaType") or header
    if doc.get("schemaVersion") != 2:
        raise SourceError(f"{what}: manifest schemaVersion {str(doc.get('schemaVersion'))[:20]!r} is not 2")
    if not isinstance(media_type, str) or media_type not in (*MANIFESTS, *INDEXES):
        raise SourceError(f"{what}: unknown manifest media type {str(media_type)[:100]!r}; known: {ACCEPT}")
    return media_type


def _descriptor(raw: Any, what: str) -> dict[str, Any]:
    """A checked descriptor: mediaType, digest (sha256 only), size in 0..2**63-1, annotations str -> str."""
    if not isinstance(raw, dict):
        raise SourceError(f"{what} is not a descriptor object")
    media_type, digest, size = raw.get("mediaType"), raw.get("digest"), raw.get("size")
    annotations = raw.get("annotations") or {}
    if not isinstance(media_type, str) or not _MEDIA_TYPE.fullmatch(media_type):
        raise SourceError(f"{what}: media type {str(media_type)[:100]!r} is not a media type")
    if not isinstance(digest, str) or not OCI_DIGEST.fullmatch(digest):
        raise SourceError(f"{what}: digest {str(digest)[:100]!r} is not sha256:<64 lowercase hex> (the only "
                          "algorithm read)")
    if not isinstance(size, int) or isinstance(size, bool) or not 0 <= size <= MAX_BLOB:
        raise SourceError(f"{what}: size {str(size)[:40]!r} is not a byte count")
    if not isinstance(annotations, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                    for k, v in annotations.items()):
        raise SourceError(f"{what}: annotations are not a string-to-string map")
    return {**raw, "annotations": annotations}


def _pick(index: dict[str, Any], what: str) -> dict[str, Any]:
    """The index entry to read: linux/amd64, else the only entry (an artifact's index)."""
    entries = index.get("manifests")
    if not isinstance(entries, builtins.list) or not entries:
        raise SourceError(f"{what}: the index lists no manifests")
    if len(entries) > MAX_INDEX:
        raise SourceError(f"{what}: the index lists {len(entries)} manifests, more than {MAX_INDEX}")
    checked = [_descriptor(e, f"{what} index entry {i}") for i, e in enumerate(entries)]
    for entry in checked:
        if entry["size"] > MANIFEST_MAX:
            raise SourceError(f"{what}: an index entry names a manifest of {entry['size']} bytes")
    amd64 = [e for e in checked if isinstance(e.get("platform"), dict)
             and e["platform"].get("os") == "linux" and e["platform"].get("architecture") == "amd64"]
    if amd64:
        return amd64[0]
    if len(checked) == 1:
        return checked[0]
    platforms = sorted({f"{p.get('os')}/{p.get('architecture')}" for e in checked
                        if isinstance(p := e.get("platform"), dict)})
    raise SourceError(f"{what}: the index has {len(checked)} manifests and none for linux/amd64 "
                      f"({', '.join(platforms)[:200] or 'no platforms'}); name one by its digest")


__all__ = ["INSECURE_ENV", "OciSource", "docker_credentials", "plain_http"]
