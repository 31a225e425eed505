"""One redaction (weightcache/redact.py): secrets with '/', '@', ':' and '%' in every component never reach the
CLI's output, a CSI error message (kubelet copies it into pod events), the daemon API's answers or log lines."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.command import weightcache
from tests.fixtures_csi import CsiHarness
from tests.fixtures_daemon import RunningDaemon
from weightcache.daemon.app import setup_logging
from weightcache.errors import InvalidReferenceError
from weightcache.redact import redact
from weightcache.uri import parse_ref

KEY_ID = "AKIAIOSFODNN7EXAMPLE"
# An AWS-style secret: '/' inside, plus '@', ':' and '%' (raw and percent-encoded) so every parser boundary is hit
SECRET_PARTS = ["wJalrXUtnFEMI/K7MDENG", "bPx@RfiCY:EXAMPLE", "KEY%2Fx%40y"]
SECRET = "/".join(SECRET_PARTS)

HOSTILE_REFS = [
    f"s3://{KEY_ID}:{SECRET}@models/x/",
    f"s3://{KEY_ID}:{SECRET}@models/x/@rev1",
    f"https://{KEY_ID}:{SECRET}@host.example:8443/models/x/",
    f"gs://{KEY_ID}:{SECRET}/@models",  # the secret ends in '/', as a revision marker would
    f"s3://{KEY_ID}%3A{SECRET}@models/x/",  # the whole userinfo percent-encoded
    f"https://{SECRET}@host.example/models/",  # a token alone, no user name
]


def secret_fragments() -> list[str]:
    """Every piece of the credentials that must never be shown (raw and decoded)."""
    from urllib.parse import unquote

    pieces = [KEY_ID, SECRET, unquote(SECRET), *SECRET_PARTS]
    return [p for p in {*pieces, *(unquote(p) for p in pieces)} if len(p) >= 6]


def assert_clean(text: str) -> None:
    for fragment in secret_fragments():
        assert fragment not in text, f"{fragment!r} leaked in {text!r}"


@pytest.mark.parametrize("ref", HOSTILE_REFS)
def test_userinfo_with_slashes_ats_colons_and_percents_is_removed(ref: str) -> None:
    for text in (ref, f"fetching {ref}: connection reset", repr(ref), f"GET {ref}?x=1 failed"):
        clean = redact(text)
        assert_clean(clean)
        assert "***" in clean


def test_a_parse_error_quoting_the_bucket_part_leaks_nothing() -> None:
    with pytest.raises(InvalidReferenceError) as caught:
        parse_ref(f"s3://{KEY_ID}:{SECRET}@models/x/")
    assert_clean(str(caught.value))
    assert "write it like" in str(caught.value)


@pytest.mark.parametrize("text", [
    "s3://models/llama-3-8b/", "s3://models/llama-3-8b/@3f2a9c", "https://host.example:8080/m/@v1.2",
    "file:///srv/models/llama/", "write it like s3://models/llama-3-8b/ (optionally s3://models/llama/@<revision>)",
    "http://[::1]:8080/m/",
])
def test_references_without_credentials_read_the_same(text: str) -> None:
    assert redact(text) == text


def test_signed_url_parameters_and_headers_are_blanked() -> None:
    text = ("GET https://b.s3.amazonaws.com/k?X-Amz-Credential=AKIAIOSFODNN7EXAMPLE%2F20260101&X-Amz-Signature="
            "deadbeefcafe&partNumber=1 failed; Authorization: AWS4-HMAC-SHA256 Credential=abc123secret, "
            "aws_secret_access_key = wJalrXUtnFEMIsecret")
    clean = redact(text)
    for secret in ("AKIAIOSFODNN7EXAMPLE", "deadbeefcafe", "Credential=abc123secret", "wJalrXUtnFEMIsecret"):
        assert secret not in clean
    assert "partNumber=1" in clean and "failed" in clean


def test_limit_cuts_after_redacting() -> None:
    clean = redact(f"{HOSTILE_REFS[0]} " + "x" * 2000, limit=100)
    assert len(clean) == 100 and clean.endswith("...")
    assert_clean(clean)


@pytest.fixture
def process_log() -> Iterator[Callable[[], str]]:
    """The daemon's real log setup (`setup_logging`, as `weightcache daemon` runs it), its stderr handler pointed
    at a buffer; yields a function returning what the process has written so far. Root's handlers are put back."""
    root = logging.getLogger()
    before, level = root.handlers[:], root.level
    setup_logging("text", "DEBUG")
    ours = [h for h in root.handlers if h not in before]
    written = io.StringIO()
    for handler in ours:
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(written)
    try:
        yield written.getvalue
    finally:
        for handler in ours:
            root.removeHandler(handler)
        for handler in before:  # pytest's own capture handlers come and go with its phases
            if not type(handler).__module__.startswith("_pytest") and handler not in root.handlers:
                root.addHandler(handler)
        root.setLevel(level)


def test_log_lines_and_tracebacks_pass_the_formatter(process_log: Callable[[], str]) -> None:
    logger = logging.getLogger("weightcache.sources.s3")
    try:
        raise RuntimeError(f"cannot open {HOSTILE_REFS[0]}")
    except RuntimeError:
        logger.exception("fetch of %s failed", HOSTILE_REFS[2])
    written = process_log()
    assert "Traceback" in written and "RuntimeError" in written and "fetch of https://***@host.example" in written
    assert_clean(written)


@pytest.mark.parametrize("name", ["weightcache.sources.s3", "botocore.endpoint", "urllib3.connectionpool", "app"])
def test_every_line_the_process_writes_is_clean_whichever_library_logs_it(
        process_log: Callable[[], str], name: str) -> None:
    logging.getLogger(name).warning("GET %s failed", HOSTILE_REFS[0])
    logging.getLogger(name).warning("Authorization: Bearer %s", SECRET_PARTS[0])
    logging.getLogger(name).warning("plain %s line", "words")
    written = process_log()
    assert_clean(written)
    assert "GET s3://***@models/x/ failed" in written and "Authorization: Bearer ***" in written
    assert f"{name}: plain words line" in written  # untouched when nothing is secret


def test_the_cli_log_setup_redacts_other_libraries_lines() -> None:
    """`weightcache` (cli.main) sets up its log once; a library's line (urllib3 quoting a URL) passes it too."""
    code = ("import logging, sys; from weightcache import cli; "
            "cli.cmd_ls = lambda args: [logging.getLogger(n).warning('GET %s failed', sys.argv[1]) "
            "for n in ('urllib3.connectionpool', 'botocore.endpoint')] and 0; "
            "sys.exit(cli.main(['--log-level', 'debug', 'ls']))")
    r = subprocess.run([sys.executable, "-c", code, HOSTILE_REFS[2]], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "urllib3.connectionpool: GET https://***@host.example:8443/models/x/ failed" in r.stderr
    assert "botocore.endpoint: GET https://***@" in r.stderr
    assert_clean(r.stdout + r.stderr)


def test_importing_the_package_leaves_global_logging_alone() -> None:
    code = ("import logging; factory = logging.getLogRecordFactory(); handlers = list(logging.getLogger().handlers); "
            "import weightcache, weightcache.loader, weightcache.redact, weightcache.redact_logs, weightcache.uri; "
            "print(logging.getLogRecordFactory() is factory, logging.getLogger().handlers == handlers)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["True", "True"]


@pytest.mark.e2e
@pytest.mark.parametrize("ref", HOSTILE_REFS[:3])
def test_the_cli_never_prints_the_secret(tmp_path: Path, ref: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "WEIGHTCACHE_SOCKET")}
    env["KUBECONFIG"] = "/nonexistent"
    r = weightcache("--log-level", "debug", "prefetch", ref, "--root", str(tmp_path / "root"), env=env)
    assert r.returncode != 0
    assert "error:" in r.stderr
    assert_clean(r.stdout + r.stderr)


@pytest.mark.parametrize("attribute", ["model", "include"])
async def test_csi_error_messages_and_request_logs_never_carry_the_secret(
        csi: CsiHarness, caplog: pytest.LogCaptureFixture, process_log: Callable[[], str], attribute: str) -> None:
    caplog.set_level(logging.DEBUG)
    if attribute == "model":
        request = csi.publish_request("vol-secret", model=HOSTILE_REFS[0])
    else:  # a broken JSON list quoting a reference
        request = csi.publish_request("vol-secret", include=f"[\"{HOSTILE_REFS[0]}\"")
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await csi.node.NodePublishVolume(request)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"volume_context.{attribute}" in (caught.value.details() or "")
    assert_clean(caught.value.details() or "")
    assert "NodePublishVolume request" in process_log()  # the debug request log ran, with volume_context
    assert_clean(process_log())
    for record in caplog.records:  # the records themselves too: an embedding application's handlers see them
        assert_clean(record.getMessage())


async def test_daemon_api_answers_and_logs_never_carry_the_secret(
        daemon: RunningDaemon, caplog: pytest.LogCaptureFixture, process_log: Callable[[], str]) -> None:
    caplog.set_level(logging.DEBUG)
    async with daemon.http() as http:
        for ref in HOSTILE_REFS:
            async with http.put("/v1/models", json={"uri": ref}) as r:
                body = await r.text()
                assert r.status == 400, body
                assert_clean(body)
            async with http.post("/v1/leases", json={"holder": "h1", "uri": ref}) as r:
                assert r.status == 400
                assert_clean(await r.text())
    assert_clean(process_log())
    for record in caplog.records:  # the records themselves too: an embedding application's handlers see them
        assert_clean(record.getMessage())


USER_CHARS = "abcXYZ019/@:%"
SECRET_CHARS = "abcXYZ019/@:%+=._-"


@settings(max_examples=500, deadline=None)
@given(user=st.text(USER_CHARS, min_size=1, max_size=20), secret=st.text(SECRET_CHARS, min_size=8, max_size=40),
       scheme=st.sampled_from(["s3", "gs", "az", "https"]), host=st.sampled_from(["models", "host.example:8443"]),
       prefix=st.sampled_from(["", "x/", "llama/3/", "m/@rev1", "a/b/@v.2"]))
def test_any_key_secret_userinfo_is_hidden(user: str, secret: str, scheme: str, host: str, prefix: str) -> None:
    text = f"fetching {scheme}://{user}:{secret}@{host}/{prefix} failed; retry"
    clean = redact(text)
    assert secret not in clean, clean
    assert clean.endswith(" failed; retry")
