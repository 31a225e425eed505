"""The http(s) listing reads the server's HTML indexes itself: what it follows, what it skips, where it stops."""

from __future__ import annotations

import http.server
import logging
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from tests.faultproxy import QuietHTTPServer
from weightcache.errors import HostileKeyError, SourceError, SourceNotFoundError
from weightcache.sources import http as http_source
from weightcache.sources import open_source
from weightcache.sources.base import SourceOptions
from weightcache.store.paths import MAX_DEPTH, MAX_FILES, MAX_PATH_BYTES
from weightcache.uri import parse_ref

PAGES: dict[str, str | bytes] = {
    "/m/": '<a href="../">../</a> <a href="?C=N;O=D">Name</a> <a href="w.bin">w.bin</a> '
           '<a HREF="sub%20dir/">sub dir/</a> <a href="/m/abs.json">abs</a> <a href="http://elsewhere/x">x</a> '
           '<a href="/other/y.bin">y</a> <a href="w.bin#frag">again</a> <a href="./sub%20dir/../w.bin">w</a>',
    "/m/sub%20dir/": '<a href="../">up</a> <a href="a%25b.json">a%b.json</a> <a href="/m/">root</a>',
    "/m/w.bin": b"0123456789",
    "/m/abs.json": b"{}",
    "/m/sub%20dir/a%25b.json": b'{"a": 1}',
    "/other/y.bin": b"not the model's",
}


#: indexes that make a backtracking href pattern take hours: a good link first, then the hostile rest
HOSTILE: dict[str, bytes] = {
    "spaces": b'<a href="ok.bin">ok</a> <a' + b" " * 100_000,
    "nested": b'<a href="ok.bin">ok</a> ' + b"<div <span <a <b " * 50_000 + b'<a href="last.bin">last</a>',
    "repeated": b'<a href="ok.bin">ok</a> ' + b"<a " * ((10 << 20) // 3),
}
#: each file linked three times, as Apache's IconsAreLinks and '#frag' anchors do
DUPS = "".join(f'<a href="{f}"><img src="/icons/f.gif"></a> <a href="{f}">{f}</a> <a href="{f}#top">top</a>'
               for f in ("a.bin", "b.bin", "c.bin")).encode()
LONG = b'<a href="' + b"x" * MAX_PATH_BYTES + b'.bin">long</a>'
MANY = "".join(f'<a href="f{i}.bin">f</a>' for i in range(MAX_FILES + 1)).encode()


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    heads: ClassVar[list[str]] = []  # paths asked for with HEAD
    gets: ClassVar[list[str]] = []  # and with GET
    busy: ClassVar[int] = 0  # answers of 503 still to give

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_GET(self) -> None:
        path = self.path
        (self.heads if self.command == "HEAD" else self.gets).append(path)
        if path.startswith("/nginx/"):  # nginx's autoindex: its Server header, no dotfile listed
            return self._send(b'<a href="w.bin">w.bin</a>' if path.endswith("/") else b"x", server="nginx/1.24.0")
        if path in ("/dups/", "/dirs/", "/long/"):
            return self._send({"/dups/": DUPS, "/long/": LONG,
                               "/dirs/": b'<a href="a/">a/</a> <a href="b/">b/</a> <a href="c.bin">c</a>'}[path])
        if path.startswith("/busy/") and self.busy:  # '²'.isdigit() is True: a Retry-After to read as ASCII
            type(self).busy -= 1
            self.send_response(503)
            self.send_header("Retry-After", "\u00b2")
            self.send_header("Content-Length", "0")
            return self.end_headers()
        if path.startswith(("/busy/", "/headless/", "/badlength/")):
            if path.endswith("/"):
                return self._send(b'<a href="f.bin">f</a>')
            if self.command == "HEAD" and path.startswith("/headless/"):
                return self._send(b"", 404)
            if self.command == "HEAD" and path.startswith("/badlength/"):
                self.send_response(200)
                self.send_header("Content-Length", "\u00b2")
                return self.end_headers()
            return self._send(b"x")
        if path.startswith(("/dups/", "/dirs/")):
            return self._send(b"x")
        if path.startswith("/hostile/"):
            name = path.split("/")[2]
            return self._send(HOSTILE[name] if path.endswith("/") else b"x")
        if path == "/many/":
            return self._send(MANY)
        if path.startswith("/deep/"):  # an index without end: every directory links one more below it
            return self._send(b'<a href="d/">d/</a> <a href="f.bin">f</a>' if path.endswith("/") else b"x")
        if path.startswith("/nolength/"):
            if path.endswith("/"):
                return self._send(b'<a href="f.bin">f</a>')
            self.send_response(200)
            self.send_header("Connection", "close")
            self.end_headers()
            if self.command == "GET":
                self.wfile.write(b"no length")
            return None
        page = PAGES.get(path)
        if page is None:
            return self._send(b"not found", 404)
        return self._send(page.encode() if isinstance(page, str) else page)

    do_HEAD = do_GET

    def _send(self, data: bytes, status: int = 200, server: str | None = None) -> None:
        if server:  # the Server header send_response writes
            self.server_version, self.sys_version = server, ""
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("ETag", f'"{len(data):x}"')
        self.end_headers()
        if self.command == "GET":
            self.wfile.write(data)


@pytest.fixture
def url() -> Iterator[str]:
    httpd = QuietHTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()


def test_links_below_the_model_are_followed_and_the_rest_skipped(url: str) -> None:
    objects = open_source(parse_ref(f"{url}/m/")).list()
    assert [(o.relpath, o.size, o.etag) for o in objects] == [
        ("abs.json", 2, "2"), ("sub dir/a%b.json", 8, "8"), ("w.bin", 10, "a")]
    assert objects[1].key == f"{url}/m/sub%20dir/a%25b.json"


def test_an_endless_index_is_refused_at_the_depth_limit_naming_the_path(url: str) -> None:
    with pytest.raises(HostileKeyError, match=f"more than {MAX_DEPTH} directories deep") as info:
        open_source(parse_ref(f"{url}/deep/")).list()
    assert "d/" * MAX_DEPTH in str(info.value)


def test_a_file_without_a_length_is_refused_with_a_hint(url: str) -> None:
    with pytest.raises(SourceError, match="no Content-Length; serve it from a static file server"):
        open_source(parse_ref(f"{url}/nolength/")).list()


def test_too_many_files_are_refused_while_walking_before_any_head(url: str) -> None:
    _Handler.heads.clear()
    with pytest.raises(HostileKeyError, match=f"more than {MAX_FILES} files"):
        open_source(parse_ref(f"{url}/many/")).list()
    assert _Handler.heads == []


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_a_hostile_index_is_listed_in_linear_time(url: str, name: str) -> None:
    # a daemon thread so that a regression fails the test instead of hanging the suite
    result: list[list[str]] = []
    thread = threading.Thread(target=lambda: result.append(
        [o.relpath for o in open_source(parse_ref(f"{url}/hostile/{name}/")).list()]), daemon=True)
    thread.start()
    thread.join(20)
    assert not thread.is_alive(), f"listing {name} took over 20 s"
    assert result == [["last.bin", "ok.bin"] if name == "nested" else ["ok.bin"]]


def test_repeated_links_count_once(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_source, "MAX_FILES", 3)
    assert [o.relpath for o in open_source(parse_ref(f"{url}/dups/")).list()] == ["a.bin", "b.bin", "c.bin"]


def test_directories_count_toward_the_file_limit_before_they_are_read(url: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_source, "MAX_FILES", 2)
    _Handler.gets.clear()
    with pytest.raises(HostileKeyError, match="more than 2 files and directories"):
        open_source(parse_ref(f"{url}/dirs/")).list()
    assert _Handler.gets == ["/dirs/"]  # neither a/ nor b/ was read


def test_a_link_longer_than_a_path_may_be_is_refused(url: str) -> None:
    with pytest.raises(HostileKeyError, match=f"path longer than {MAX_PATH_BYTES} bytes"):
        open_source(parse_ref(f"{url}/long/")).list()


def test_files_outside_the_globs_are_neither_counted_nor_asked_for(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_source, "MAX_FILES", 1)
    _Handler.heads.clear()
    objects = open_source(parse_ref(f"{url}/dups/", exclude=["[ab].bin"])).list()
    assert [o.relpath for o in objects] == ["c.bin"]
    assert _Handler.heads == ["/dups/c.bin"]


def test_a_head_that_answers_404_is_not_found(url: str) -> None:
    with pytest.raises(SourceNotFoundError, match=r"HEAD .*/headless/f.bin: HTTP 404; check the URL"):
        open_source(parse_ref(f"{url}/headless/")).list()


def test_a_length_in_non_ascii_digits_is_refused_with_a_hint(url: str) -> None:
    with pytest.raises(SourceError, match=r"Content-Length '\u00b2' is not a byte count; serve it from a static"):
        open_source(parse_ref(f"{url}/badlength/")).list()


def test_a_busy_server_is_retried_whatever_its_retry_after(url: str) -> None:
    _Handler.busy = 2  # the index, then the HEAD
    source = open_source(parse_ref(f"{url}/busy/"), SourceOptions(backoff=0.01))
    assert [(o.relpath, o.size) for o in source.list()] == [("f.bin", 1)]
    assert _Handler.busy == 0


def test_an_index_that_hides_dotfiles_says_so(url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="weightcache.sources.http"):
        assert [o.relpath for o in open_source(parse_ref(f"{url}/nginx/")).list()] == ["w.bin"]
    assert "never lists dotfiles" in caplog.text and "nginx/1.24.0" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="weightcache.sources.http"):
        open_source(parse_ref(f"{url}/m/")).list()  # Python's http.server lists dotfiles: nothing to say
    assert "dotfiles" not in caplog.text
