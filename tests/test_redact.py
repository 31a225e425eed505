"""One redaction (weightcache/redact.py): secrets with '/', '@', ':' and '%' in every component never reach the
CLI's output, a CSI error message (kubelet copies it into pod events), the daemon API's answers or log lines."""

from __future__ import annotations

import io
import logging
import os
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.fixtures_csi import (  # noqa: F401 - fixtures are used by name
    CsiHarness,
    csi,
    model_in_s3,
    safe_tmp,
)
from tests.fixtures_daemon import RunningDaemon, daemon, model_copy, short_dir, tiny_model  # noqa: F401
from tests.fixtures_s3 import fault_proxy, s3, s3_server  # noqa: F401
from weightcache.errors import InvalidReferenceError
from weightcache.redact import RedactingFormatter, redact
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


def test_log_lines_and_tracebacks_pass_the_formatter() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(RedactingFormatter(logging.Formatter("%(levelname)s %(message)s")))
    logger = logging.getLogger("test_redact.formatter")
    logger.addHandler(handler)
    try:
        try:
            raise RuntimeError(f"cannot open {HOSTILE_REFS[0]}")
        except RuntimeError:
            logger.exception("fetch of %s failed", HOSTILE_REFS[2])
    finally:
        logger.removeHandler(handler)
    assert "Traceback" in out.getvalue() and "RuntimeError" in out.getvalue()
    assert_clean(out.getvalue())


def test_records_of_our_loggers_are_clean_for_any_handler(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    logging.getLogger("weightcache.sources.s3").warning("GET %s failed", HOSTILE_REFS[0])
    logging.getLogger("weightcache.sources.s3").warning("plain %s line", "words")
    (record, plain) = caplog.records
    assert_clean(record.getMessage())
    assert "s3://***@models/x/" in record.getMessage()
    assert (plain.msg, plain.args) == ("plain %s line", ("words",))  # untouched when nothing is secret


@pytest.mark.parametrize("ref", HOSTILE_REFS[:3])
def test_the_cli_never_prints_the_secret(tmp_path: Path, ref: str) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("KUBECONFIG", "WEIGHTCACHE_SOCKET")}
    env["KUBECONFIG"] = "/nonexistent"
    r = subprocess.run([sys.executable, "-m", "weightcache", "--log-level", "debug", "prefetch", ref,
                        "--root", str(tmp_path / "root")], capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode != 0
    assert "error:" in r.stderr
    assert_clean(r.stdout + r.stderr)


@pytest.mark.parametrize("attribute", ["model", "include"])
async def test_csi_error_messages_and_request_logs_never_carry_the_secret(
        csi: CsiHarness, caplog: pytest.LogCaptureFixture, attribute: str) -> None:
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
    assert "NodePublishVolume request" in caplog.text  # the debug request log ran, with volume_context
    assert_clean(caplog.text)
    for record in caplog.records:
        assert_clean(record.getMessage())


async def test_daemon_api_answers_and_logs_never_carry_the_secret(
        daemon: RunningDaemon, caplog: pytest.LogCaptureFixture) -> None:
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
    for record in caplog.records:
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
