"""file://, memory:// and http:// sources: one contract every backend passes, then each backend's own cases.

The http:// server is ours (below): a static file server on 127.0.0.1 with an nginx-style directory index,
Range, strong ETags and If-Match, and switches for the failures a real server produces.
"""

from __future__ import annotations

import html
import http.server
import importlib.util
import os
import random
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import quote, unquote

import fsspec
import pytest

from tests.faultproxy import QuietHTTPServer
from weightcache.errors import (
    BackendMissingError,
    InvalidReferenceError,
    ObjectChangedError,
    RetriesExceededError,
    SourceError,
    SourceNotFoundError,
)
from weightcache.sources import ObjectInfo, Source, open_source
from weightcache.uri import ModelRef, parse_ref

FILES = {
    "model-00001-of-00002.safetensors": random.Random(1).randbytes(200_000),
    "model-00002-of-00002.safetensors": random.Random(2).randbytes(70_001),
    "config.json": b'{"model_type": "llama"}',
    "sub dir/tokenizer.json": b'{"version": "1.0"}',
    "sub dir/deeper/merges.txt": b"a b\n",
}


# --- the http server -----------------------------------------------------------------------------------------


@dataclass
class StaticServer:
    root: Path
    url: str
    requests: list[dict[str, str]] = field(default_factory=list)
    fail_next: list[str] = field(default_factory=list)  # "503" or "truncate", taken by ranged GETs in order


class _StaticHandler(http.server.BaseHTTPRequestHandler):
    """GET/HEAD of files under `state.root` with Range and If-Match; directories as an nginx-like index."""

    state: StaticServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        self.state.requests.append({"method": self.command, "path": self.path, **self.headers})
        path = self.state.root / unquote(self.path.split("?")[0]).lstrip("/")
        if self.state.root.resolve() not in path.resolve().parents and path.resolve() != self.state.root.resolve():
            return self._send(403, b"")
        if path.is_dir():
            return self._index(path)
        if not path.is_file():
            return self._send(404, b"not found")
        st = path.stat()
        etag = f'"{st.st_mtime_ns:x}-{st.st_size:x}"'
        if self.headers.get("If-Match") not in (None, "*", etag):
            return self._send(412, b"precondition failed")
        data = path.read_bytes()
        status, extra = 200, {"ETag": etag, "Accept-Ranges": "bytes"}
        if rng := self.headers.get("Range"):
            start, _, end = rng.removeprefix("bytes=").partition("-")
            first, last = int(start), min(int(end or len(data) - 1), len(data) - 1)
            status, data = 206, data[first:last + 1]
            extra["Content-Range"] = f"bytes {first}-{last}/{st.st_size}"
            if self.state.fail_next and self.command == "GET":
                fault = self.state.fail_next.pop(0)
                if fault == "503":
                    return self._send(503, b"busy", {"Retry-After": "0"})
                self._send(status, data, extra, body=data[:len(data) // 2])
                self.close_connection = True
                return
        self._send(status, data, extra)

    do_HEAD = do_GET

    def _index(self, path: Path) -> None:
        if not self.path.endswith("/"):
            return self._send(301, b"", {"Location": self.path + "/"})
        links = ['<a href="../">../</a>'] + [
            f'<a href="{quote(p.name)}{"/" if p.is_dir() else ""}">{html.escape(p.name)}</a>'
            for p in sorted(path.iterdir())]
        self._send(200, ("<html><body><pre>" + "\n".join(links) + "</pre></body></html>").encode(),
                   {"Content-Type": "text/html"})

    def _send(self, status: int, data: bytes, headers: dict[str, str] | None = None, *, body: bytes | None = None):
        self.send_response(status)
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data if body is None else body)


@pytest.fixture
def static_server(tmp_path: Path) -> Iterator[StaticServer]:
    root = tmp_path / "www"
    root.mkdir()
    state = StaticServer(root, "")
    server = QuietHTTPServer(("127.0.0.1", 0), type("H", (_StaticHandler,), {"state": state}))
    state.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield state
    server.shutdown()
    server.server_close()


# --- one contract, every backend -----------------------------------------------------------------------------


@dataclass
class Backend:
    ref: ModelRef
    write: Callable[[str, bytes], None]  # relpath, data: create or replace an object


def _write_file(root: Path) -> Callable[[str, bytes], None]:
    def write(relpath: str, data: bytes) -> None:
        path = root / relpath
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)  # a new inode, as a re-upload would be
        os.utime(path, ns=(time.time_ns(), time.time_ns() + 1_000_000))  # a distinct mtime even on coarse clocks
    return write


@pytest.fixture(params=["file", "memory", "http"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Backend]:
    if request.param == "file":
        root = tmp_path / "models" / "m"
        yield Backend(parse_ref(f"file://{root}/"), _write_file(root))
    elif request.param == "memory":
        fs, bucket = fsspec.filesystem("memory"), f"t{uuid.uuid4().hex[:12]}"
        yield Backend(parse_ref(f"memory://{bucket}/m/"), lambda rel, data: fs.pipe(f"/{bucket}/m/{rel}", data))
        if fs.exists(f"/{bucket}"):
            fs.rm(f"/{bucket}", recursive=True)
    else:
        server = request.getfixturevalue("static_server")
        yield Backend(parse_ref(f"{server.url}/m/"), _write_file(server.root / "m"))


@pytest.fixture
def loaded(backend: Backend) -> Iterator[tuple[Backend, Source]]:
    for relpath, data in FILES.items():
        backend.write(relpath, data)
    source = open_source(backend.ref, backoff=0.01)
    yield backend, source
    source.close()


def _find(source: Source, relpath: str) -> ObjectInfo:
    return next(o for o in source.list() if o.relpath == relpath)


def test_contract_list_is_recursive_sorted_with_sizes(loaded: tuple[Backend, Source]) -> None:
    backend, source = loaded
    objects = source.list()
    assert [o.relpath for o in objects] == sorted(FILES)
    assert [o.size for o in objects] == [len(FILES[o.relpath]) for o in objects]
    assert source.name == backend.ref.scheme
    assert all(o.etag for o in objects)  # every backend pins a version


def test_contract_globs(backend: Backend) -> None:
    for relpath, data in FILES.items():
        backend.write(relpath, data)
    source = open_source(parse_ref(str(backend.ref), include=["*.safetensors", "sub dir/*"], exclude=["*/merges.txt"]))
    assert [o.relpath for o in source.list()] == [
        "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "sub dir/tokenizer.json"]


def test_contract_nothing_there_is_not_found(backend: Backend) -> None:
    with pytest.raises(SourceNotFoundError, match=rf"no objects under {backend.ref.uri}; check"):
        open_source(backend.ref).list()


@pytest.mark.parametrize(("offset", "length"), [(0, 1), (0, 200_000), (199_999, 1), (4096, 100_000)])
def test_contract_read_into_exact_bytes(loaded: tuple[Backend, Source], offset: int, length: int) -> None:
    _, source = loaded
    buf = bytearray(length)
    source.read_into(_find(source, "model-00001-of-00002.safetensors"), offset, memoryview(buf))
    assert buf == FILES["model-00001-of-00002.safetensors"][offset:offset + length]


def test_contract_read_pieces(loaded: tuple[Backend, Source]) -> None:
    _, source = loaded
    obj = _find(source, "model-00002-of-00002.safetensors")
    heard: list[int] = []
    got = b"".join(bytes(v) for _, v in source.read_pieces(obj, 1, obj.size - 1, memoryview(bytearray(30_000)),
                                                           heard.append))
    assert got == FILES[obj.relpath][1:]
    assert sum(heard) == obj.size - 1


def test_contract_a_replaced_object_is_detected(loaded: tuple[Backend, Source]) -> None:
    backend, source = loaded
    old = _find(source, "config.json")
    time.sleep(0.002)  # memory:// stamps objects with a microsecond clock
    backend.write("config.json", b'{"model_type": "mistral"}')
    with pytest.raises(ObjectChangedError):
        source.read_into(old, 0, memoryview(bytearray(4)))


def test_contract_concurrent_reads(loaded: tuple[Backend, Source]) -> None:
    _, source = loaded
    obj = _find(source, "model-00001-of-00002.safetensors")
    out = bytearray(obj.size)
    view = memoryview(out)
    threads = [threading.Thread(target=source.read_into, args=(obj, pos, view[pos:pos + 25_000]))
               for pos in range(0, obj.size, 25_000)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == FILES[obj.relpath]


# --- backend specifics ---------------------------------------------------------------------------------------


def test_file_missing_directory_is_not_found(tmp_path: Path) -> None:
    with pytest.raises(SourceNotFoundError, match="check that the directory exists"):
        open_source(parse_ref(f"file://{tmp_path}/absent/")).list()


def test_file_removed_after_listing_is_not_found(tmp_path: Path) -> None:
    _write_file(tmp_path)("config.json", b"{}")
    source = open_source(parse_ref(f"file://{tmp_path}/"))
    obj = _find(source, "config.json")
    Path(obj.key).unlink()
    with pytest.raises(SourceNotFoundError):
        source.read_into(obj, 0, memoryview(bytearray(2)))


def test_file_symlinks_count_as_their_targets(tmp_path: Path) -> None:
    """A Hugging Face cache snapshot: relative symlinks into the repo's blob directory."""
    (tmp_path / "blobs").mkdir()
    (tmp_path / "blobs" / "abc").write_bytes(b"weights")
    (tmp_path / "snapshots" / "rev1" / "sub").mkdir(parents=True)
    (tmp_path / "snapshots" / "rev1" / "model.bin").symlink_to("../../blobs/abc")
    (tmp_path / "snapshots" / "rev1" / "sub" / "copy.bin").symlink_to("../../../blobs/abc")
    source = open_source(parse_ref(f"file://{tmp_path}/snapshots/rev1/"))

    objects = source.list()

    assert [(o.relpath, o.size) for o in objects] == [("model.bin", 7), ("sub/copy.bin", 7)]
    buf = bytearray(3)
    source.read_into(objects[0], 4, memoryview(buf))
    assert buf == b"hts"
    _write_file(tmp_path / "blobs")("abc", b"WEIGHTS")  # the target replaced: the link's version changed
    with pytest.raises(ObjectChangedError):
        source.read_into(objects[0], 0, memoryview(buf))


def test_file_symlink_to_a_directory_is_refused_with_a_hint(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "snap").mkdir()
    (tmp_path / "snap" / "linked").symlink_to("../elsewhere")
    with pytest.raises(SourceError, match=r"not a regular file .*point the reference at the target directory"):
        open_source(parse_ref(f"file://{tmp_path}/snap/")).list()


def test_http_reads_are_ranged_and_pinned(static_server: StaticServer) -> None:
    _write_file(static_server.root / "m")("w.bin", FILES["config.json"])
    source = open_source(parse_ref(f"{static_server.url}/m/"))
    obj = _find(source, "w.bin")
    static_server.requests.clear()
    source.read_into(obj, 3, memoryview(bytearray(5)))
    (req,) = static_server.requests
    assert (req["method"], req["Range"], req["If-Match"]) == ("GET", "bytes=3-7", f'"{obj.etag}"')


def test_http_names_are_unquoted(static_server: StaticServer) -> None:
    _write_file(static_server.root / "m")("sub dir/a%b.json", b"{}")
    (obj,) = open_source(parse_ref(f"{static_server.url}/m/")).list()
    assert obj.relpath == "sub dir/a%b.json"
    assert obj.key.endswith("/m/sub%20dir/a%25b.json")


def test_http_retries_503_and_resumes_a_short_body(static_server: StaticServer) -> None:
    data = FILES["model-00002-of-00002.safetensors"]
    _write_file(static_server.root / "m")("w.bin", data)
    source = open_source(parse_ref(f"{static_server.url}/m/"), backoff=0.01)
    obj = _find(source, "w.bin")
    static_server.fail_next[:] = ["503", "truncate"]
    static_server.requests.clear()
    buf = bytearray(10_000)

    source.read_into(obj, 100, memoryview(buf))

    assert buf == data[100:10_100]
    assert [r["Range"] for r in static_server.requests] == ["bytes=100-10099", "bytes=100-10099", "bytes=5100-10099"]


def test_http_retries_run_out(static_server: StaticServer) -> None:
    _write_file(static_server.root / "m")("w.bin", b"0123456789")
    source = open_source(parse_ref(f"{static_server.url}/m/"), backoff=0.01, max_attempts=2)
    obj = _find(source, "w.bin")
    static_server.fail_next[:] = ["503"] * 5
    with pytest.raises(RetriesExceededError, match=r"failed 2 times, last: HTTP 503"):
        source.read_into(obj, 1, memoryview(bytearray(2)))


def test_http_deleted_file_is_not_found(static_server: StaticServer) -> None:
    _write_file(static_server.root / "m")("w.bin", b"0123456789")
    source = open_source(parse_ref(f"{static_server.url}/m/"))
    obj = _find(source, "w.bin")
    shutil.rmtree(static_server.root / "m")
    with pytest.raises(SourceNotFoundError, match="HTTP 404; check the URL"):
        source.read_into(obj, 0, memoryview(bytearray(2)))


@pytest.mark.parametrize(("uri", "package"), [("gs://models/m/", "gcsfs"), ("az://models/m/", "adlfs")])
def test_a_missing_backend_says_what_to_install(uri: str, package: str) -> None:
    if importlib.util.find_spec(package):
        pytest.skip(f"{package} is installed")
    with pytest.raises(BackendMissingError, match=rf"needs the {package} package: pip install {package}") as info:
        open_source(parse_ref(uri))
    assert isinstance(info.value, ImportError)


def test_an_unknown_scheme_is_refused() -> None:
    with pytest.raises(InvalidReferenceError, match="use one of: s3, http"):
        open_source(ModelRef("ftp", "host", "m/"))


def test_prefetch_of_a_missing_backend_exits_2_with_the_pip_command(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    if importlib.util.find_spec("gcsfs"):
        pytest.skip("gcsfs is installed")
    from weightcache.cli import main

    assert main(["prefetch", "--no-daemon", "gs://models/m/", "--root", str(tmp_path / "root")]) == 2
    assert "pip install gcsfs" in capsys.readouterr().err


def test_a_checksum_a_gs_or_az_listing_carries_is_taken_only_when_well_formed() -> None:
    """gs:// md5Hash (else crc32c) and az:// Content-MD5 check the downloaded bytes (the object-store tier checks
    them against fake-gcs-server and Azurite); a value that is no digest of the right size is no checksum."""
    import base64

    from weightcache.sources.fsspec import listed_checksum

    md5, crc = bytes(range(16)), b"\x01\x02\x03\x04"
    assert listed_checksum({"md5Hash": base64.b64encode(md5).decode(), "crc32c": base64.b64encode(crc).decode()}) \
        == ("md5", md5.hex())
    assert listed_checksum({"crc32c": base64.b64encode(crc).decode()}) == ("crc32c", "01020304")  # composed
    assert listed_checksum({"content_settings": {"content_md5": bytearray(md5)}}) == ("md5", md5.hex())
    assert listed_checksum({"md5Hash": "not base64!", "crc32c": "AQID"}) is None  # 3 bytes: no CRC32C
    assert listed_checksum({"md5Hash": base64.b64encode(md5[:15]).decode()}) is None
    assert listed_checksum({"content_settings": {"content_md5": None}, "etag": "0x8D"}) is None
