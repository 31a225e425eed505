"""Synchronous client of the daemon's API over its Unix socket (stdlib only), for the CLI.

It speaks the little HTTP/1.1 the API needs itself (`_UnixConnection`): http.client imports the email package
and ssl, 20 ms of the 0.1-0.2 s a cache hit through the daemon costs the CLI (docs/fetch.md, "Small models").

Going through the daemon when it runs means joining its single flight and its metrics. Error answers
(`{"error": code, "message": ...}`) are raised again as the same exception classes the store raises, so the
CLI handles one set of errors whichever way it went.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import re
import socket
from collections.abc import Callable
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import quote, urlencode

from weightcache import defaults, errors

if TYPE_CHECKING:
    from weightcache.progress import ProgressWire

TIMEOUT_S = 30.0  # per socket operation; a streaming ensure may last hours, but sends a line at least this often


MAX_LINE = 1 << 16  # an answer's status or header line, or a progress line, longer than this is no daemon's
MAX_HEADERS = 100


class _UnixConnection:
    """One request and its answer on a new connection to the daemon's socket (`Connection: close`): a body of
    bytes, or a file sent in chunks; the answer's body by Content-Length, in chunks, or to the end. `timeout`:
    per socket operation, None for none."""

    def __init__(self, path: Path, timeout: float | None) -> None:
        self._path, self.timeout = path, timeout
        self._sock: socket.socket | None = None

    def request(self, method: str, path: str, body: str | bytes | IO[bytes] | None = None,
                headers: dict[str, str] | None = None) -> None:
        """Send the request; a file `body` is read and sent in chunks (its length unknown)."""
        sock = self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(str(self._path))
        head = [f"{method} {path} HTTP/1.1", "Host: localhost", "Connection: close",
                *(f"{k}: {v}" for k, v in (headers or {}).items())]
        if body is None or isinstance(body, str | bytes):
            data = body.encode() if isinstance(body, str) else body or b""
            sock.sendall(("\r\n".join([*head, f"Content-Length: {len(data)}"]) + "\r\n\r\n").encode("latin-1")
                         + data)
            return
        sock.sendall(("\r\n".join([*head, "Transfer-Encoding: chunked"]) + "\r\n\r\n").encode("latin-1"))
        while chunk := body.read(1 << 16):
            sock.sendall(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        sock.sendall(b"0\r\n\r\n")

    def getresponse(self) -> _Response:
        if self._sock is None:
            raise DaemonError("no request sent", code="unavailable", status=503)
        return _Response(self._sock.makefile("rb"))

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class _Response:
    """The daemon's answer: `status`, then its body whole (`read`) or a line at a time (`readline`)."""

    def __init__(self, stream: Any) -> None:
        self._in = stream
        line = stream.readline(MAX_LINE)
        if not line:
            raise ConnectionResetError("the daemon closed the connection without an answer")
        version, _, rest = line.decode("latin-1").partition(" ")
        code = rest[:3]
        if not version.startswith("HTTP/1.") or not (code.isascii() and code.isdigit()):
            raise DaemonError(f"not an HTTP answer on the daemon's socket: {line[:80]!r}", code="unavailable",
                              status=502)
        self.status = int(code)
        fields: dict[str, str] = {}
        for _ in range(MAX_HEADERS + 1):
            line = stream.readline(MAX_LINE)
            if line in (b"\r\n", b"\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            fields[name.strip().lower()] = value.strip()
        else:
            raise DaemonError("the daemon's answer has too many header lines", code="unavailable", status=502)
        self._chunked = fields.get("transfer-encoding", "").lower() == "chunked"
        length = fields.get("content-length", "")
        self._left = 0 if self.status in (204, 304) else int(length) if length.isascii() and length.isdigit() else None
        self._buf = b""
        self._eof = False

    def _more(self) -> bytes:
        """The body's next bytes (b"" at its end)."""
        if self._eof:
            return b""
        if self._chunked:
            size_line = self._in.readline(MAX_LINE).split(b";")[0].strip()
            try:
                size = int(size_line, 16)
            except ValueError:
                size = 0  # a cut stream: the end
            if size <= 0:
                self._eof = True
                return b""
            data = self._in.read(size)
            self._in.readline(MAX_LINE)  # the CRLF after the chunk
            self._eof = len(data) < size
            return bytes(data)
        if self._left is not None:
            data = self._in.read(min(self._left, 1 << 16)) if self._left else b""
            self._left -= len(data)
        else:
            data = self._in.read1(1 << 16)
        self._eof = not data
        return bytes(data)

    def read(self) -> bytes:
        parts = [self._buf]
        self._buf = b""
        while data := self._more():
            parts.append(data)
        return b"".join(parts)

    def readline(self) -> bytes:
        """The body's next line, with its newline (b"" at the end)."""
        while b"\n" not in self._buf and len(self._buf) < MAX_LINE:
            data = self._more()
            if not data:
                break
            self._buf += data
        end = self._buf.find(b"\n") + 1 or len(self._buf)
        line, self._buf = self._buf[:end], self._buf[end:]
        return line


class DaemonError(errors.WeightcacheError):
    """The daemon answered an error this client has no class for (or is not answering as a daemon should)."""

    answer = errors.Answer(1, 502, "UNAVAILABLE")

    def __init__(self, message: str, *, code: str = "internal", status: int = 500) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def error_code(cls: type[BaseException]) -> str:
    """`NotCachedError` -> `not_cached`: the wire code of an exception class (the API sends it, we map back)."""
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__.removesuffix("Error") or "Error").lower()


def _classes() -> dict[str, type[errors.WeightcacheError]]:
    return {error_code(v): v for v in vars(errors).values()
            if isinstance(v, type) and issubclass(v, errors.WeightcacheError)}


def raise_for(status: int, body: Any) -> None:
    """Raise the exception an error answer stands for."""
    code = body.get("error", "internal") if isinstance(body, dict) else "internal"
    message = body.get("message", "") if isinstance(body, dict) else str(body)[:500]
    held_by = body.get("held_by") if isinstance(body, dict) else None
    if isinstance(held_by, list) and held_by:  # a refused eviction: say who holds the model, as the store does
        message += f". Held by: {'; '.join(map(str, held_by))}"
    cls = _classes().get(code)
    try:
        exc = cls(message) if cls is not None else None
    except TypeError:  # a class whose constructor wants more than a message
        exc = errors.InvalidReferenceError(message) if status == 400 else None
    raise exc or DaemonError(message or f"daemon answered HTTP {status}", code=code, status=status)


class DaemonClient:
    """`DaemonClient(defaults.socket()).list()`; each call opens one connection (the daemon is local)."""

    def __init__(self, socket_path: str | Path | None = None, *, timeout: float = TIMEOUT_S) -> None:
        self.socket_path = Path(socket_path) if socket_path else defaults.socket()
        self.timeout = timeout

    def available(self) -> bool:
        """True when a daemon answers on the socket (a stale socket file is not a daemon)."""
        try:
            self._call("GET", "/healthz")
        except (OSError, errors.WeightcacheError):
            return False
        return True

    def ensure(
        self,
        uri: str,
        *,
        revision: str | None = None,
        include: tuple[str, ...] | list[str] = (),
        exclude: tuple[str, ...] | list[str] = (),
        tier: str = "disk",
        pin: bool = False,
        signature: dict[str, Any] | None = None,
        on_progress: Callable[[ProgressWire], None] | None = None,
    ) -> dict[str, Any]:
        """Ensure a model and wait for it; `on_progress` hears each progress line as it came, in the one wire form
        (`Progress.from_wire` makes it the value again). `signature`: a requirement in the shape of a ModelCache's
        `spec.signature` (docs/signing.md). Returns the snapshot dict."""
        body: dict[str, Any] = {"uri": uri, "revision": revision, "include": list(include), "exclude": list(exclude),
                                "tier": tier, "pin": pin}
        if signature is not None:  # only when asked: a daemon before signatures refuses the unknown field
            body["signature"] = signature
        conn = self._connect()
        try:
            conn.request("PUT", "/v1/models?wait=1", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise_for(response.status, _decode(response.read()))
            return _follow(response, on_progress)
        finally:
            conn.close()

    def list(self) -> list[dict[str, Any]]:
        return self._call("GET", "/v1/models")  # type: ignore[no-any-return]

    def get(self, snapshot_id: str) -> dict[str, Any]:
        return self._call("GET", f"/v1/models/{quote(snapshot_id, safe='')}")  # type: ignore[no-any-return]

    def delete(self, snapshot_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/models/{quote(snapshot_id, safe='')}")  # type: ignore[no-any-return]

    def pin(self, snapshot_id: str) -> dict[str, Any]:
        return self._call("PUT", f"/v1/models/{quote(snapshot_id, safe='')}/pin")  # type: ignore[no-any-return]

    def unpin(self, snapshot_id: str) -> dict[str, Any]:
        return self._call("DELETE", f"/v1/models/{quote(snapshot_id, safe='')}/pin")  # type: ignore[no-any-return]

    def verify(self, snapshot_id: str, *, repair: bool = False) -> dict[str, Any]:
        """Re-hash one snapshot on the daemon (which may take minutes on a big model: no socket timeout)."""
        return self._call("POST", f"/v1/models/{quote(snapshot_id, safe='')}/verify",  # type: ignore[no-any-return]
                          {"repair": repair}, long=True)

    def evict_to(self, size: int) -> dict[str, Any]:
        return self._call("POST", "/v1/evict", {"to_size": size})  # type: ignore[no-any-return]

    def gc(self) -> dict[str, Any]:
        return self._call("POST", "/v1/gc", {}, long=True)  # type: ignore[no-any-return]

    def leases(self) -> dict[str, str]:
        return self._call("GET", "/v1/leases")  # type: ignore[no-any-return]

    def lease(self, holder: str, *, uri: str | None = None, snapshot: str | None = None) -> dict[str, Any]:
        return self._call("POST", "/v1/leases", {"holder": holder, "uri": uri, "snapshot": snapshot})  # type: ignore[no-any-return]

    def release(self, holder: str) -> None:
        self._call("DELETE", f"/v1/leases/{quote(holder, safe='')}")

    def engine_caches(self, *, namespace: str | None = None) -> builtins.list[dict[str, Any]]:
        return self._call("GET", "/v1/engine-caches" + _query({"namespace": namespace}))  # type: ignore[no-any-return]

    def engine_cache(self, name: str, model: dict[str, Any]) -> dict[str, Any]:
        """The engine cache `name` for `model` ({uri, revision, include, exclude, namespace}); NotCachedError."""
        return self._call("GET", _engine_path(name, model))  # type: ignore[no-any-return]

    def fill_engine_cache(self, name: str, model: dict[str, Any], snapshot: str) -> dict[str, Any]:
        """The admin's engine cache `name` for `model` from a peer holding snapshot `snapshot` (its content id)."""
        path = _engine_path(name, {**model, "snapshot": snapshot}, "/fill")
        return self._call("POST", path, None, long=True)  # type: ignore[no-any-return]

    def put_engine_cache(self, name: str, model: dict[str, Any], directory: str | Path) -> dict[str, Any]:
        """Hand directory `directory` over as engine cache `name` for `model`: streamed as an uncompressed tar
        built as it is sent (bounded memory); links go as links, and the daemon refuses them by name."""
        read_fd, write_fd = os.pipe()
        failed: list[BaseException] = []

        import tarfile  # here, as threading: no other call needs them (a CLI that has no thread leaves sooner: entry)
        import threading

        def write_tar() -> None:
            try:
                with os.fdopen(write_fd, "wb") as out, tarfile.open(fileobj=out, mode="w|",
                                                                    format=tarfile.PAX_FORMAT) as tf:
                    for entry in sorted(os.listdir(directory)):  # not "." itself: the tar holds the contents
                        tf.add(os.path.join(directory, entry), arcname=entry)
            except BrokenPipeError:  # the daemon stopped reading (a refusal): its answer says why
                pass
            except BaseException as exc:
                failed.append(exc)

        writer = threading.Thread(target=write_tar, name="wc-engine-cache-tar", daemon=True)
        writer.start()
        conn = self._connect(long=True)
        try:
            with os.fdopen(read_fd, "rb") as body:
                # the daemon may answer (a refusal) before the whole body: then read its answer
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    conn.request("POST", _engine_path(name, model), body, {"Content-Type": "application/x-tar"})
                response = conn.getresponse()
                payload = response.read()
        finally:
            conn.close()
            writer.join()
        if failed:
            raise failed[0]
        decoded = _decode(payload)
        if response.status != 201:
            raise_for(response.status, decoded)
        return decoded  # type: ignore[no-any-return]

    def ready(self) -> dict[str, Any]:
        """The /readyz answer ({"ready": bool, "checks": {...}}), whatever its status."""
        return self._call("GET", "/readyz", ok=(200, 503))  # type: ignore[no-any-return]

    def status(self) -> dict[str, Any] | None:
        """GET /v1/status (the bandwidth limits in force); None from a daemon too old to have it (404)."""
        answer = self._call("GET", "/v1/status", ok=(200, 404))
        return answer if isinstance(answer, dict) and "error" not in answer else None

    def metrics(self) -> str:
        return self._call("GET", "/metrics", raw=True)  # type: ignore[no-any-return]

    def _connect(self, *, long: bool = False) -> _UnixConnection:
        """`long`: a request that works before it answers (verify, gc): no timeout on the wait."""
        return _UnixConnection(self.socket_path, None if long else self.timeout)

    def _call(self, method: str, path: str, body: Any = None, *, ok: tuple[int, ...] = (200, 201, 202),
              raw: bool = False, long: bool = False) -> Any:
        conn = self._connect(long=long)
        try:
            data = None if body is None else json.dumps(body)
            conn.request(method, path, data, {"Content-Type": "application/json"} if data else {})
            response = conn.getresponse()
            payload = response.read()
        finally:
            conn.close()
        if raw and response.status in ok:
            return payload.decode()
        decoded = _decode(payload)
        if response.status not in ok:
            raise_for(response.status, decoded)
        return decoded


def _query(params: dict[str, Any]) -> str:
    pairs = [(k, x) for k, v in params.items() for x in (v if isinstance(v, list | tuple) else [v]) if x]
    return "?" + urlencode(pairs) if pairs else ""


def _engine_path(name: str, model: dict[str, Any], suffix: str = "") -> str:
    return f"/v1/engine-caches/{quote(name, safe='')}{suffix}" + _query(model)


def _decode(payload: bytes) -> Any:
    try:
        return json.loads(payload)
    except ValueError:
        return payload.decode(errors="replace")


def _follow(response: _Response, on_progress: Callable[[ProgressWire], None] | None
            ) -> dict[str, Any]:
    """Read NDJSON lines until the final snapshot or error line."""
    while True:
        line = response.readline()
        if not line:
            raise DaemonError("the daemon closed the progress stream before the result (did it stop?); "
                              "run the command again: the fetch resumes", code="unavailable", status=503)
        if not line.strip():
            continue
        item = json.loads(line)
        if "progress" in item:
            if on_progress is not None:
                on_progress(item["progress"])
        elif "snapshot" in item:
            return dict(item["snapshot"])
        elif "error" in item:
            raise_for(500, item)
