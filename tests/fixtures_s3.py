"""S3 fixtures: a real S3 server (moto) on 127.0.0.1, reset before each test, and a fault proxy in front of it.

    def test_fetch(s3, fault_proxy):
        s3.upload_dir(model_dir, "models", "llama/")          # bucket created when missing
        s3.put("models", "llama/extra.json", b"{}")
        source = open_source(parse_ref("s3://models/llama/"), endpoint_url=s3.endpoint_url)
        flaky = open_source(parse_ref("s3://models/llama/"), endpoint_url=fault_proxy.endpoint_url)
        fault_proxy.add("slowdown", method="GET", count=2)

Credentials are dummies set for the whole session (moto accepts any); `AWS_ENDPOINT_URL` is left alone, so pass
`endpoint_url` explicitly or set it with monkeypatch in the test that needs it.
"""

from __future__ import annotations

import contextlib
import os
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from tests.faultproxy import FaultProxy

_DUMMY_ENV = {
    "AWS_ACCESS_KEY_ID": "testing-key-id",
    "AWS_SECRET_ACCESS_KEY": "testing-secret",
    "AWS_SESSION_TOKEN": "testing-token",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_CONFIG_FILE": os.devnull,  # never the developer's profiles
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
}


@dataclass(frozen=True)
class S3:
    """What a test gets from the `s3` fixture."""

    endpoint_url: str
    client: Any  # boto3 S3 client, path-style, talking straight to moto

    def create_bucket(self, bucket: str, *, versioned: bool = False) -> None:
        with contextlib.suppress(self.client.exceptions.BucketAlreadyOwnedByYou):
            self.client.create_bucket(Bucket=bucket)
        if versioned:
            self.client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})

    def put(self, bucket: str, key: str, data: bytes, **extra: Any) -> dict[str, Any]:
        """put_object (bucket created when missing); `extra` goes to put_object, e.g. ChecksumAlgorithm="SHA256"."""
        self.create_bucket(bucket)
        return self.client.put_object(Bucket=bucket, Key=key, Body=data, **extra)

    def upload_dir(self, local_dir: str | Path, bucket: str, prefix: str) -> None:
        """Upload every file under `local_dir` to `bucket` as `prefix` + its '/'-separated relative path."""
        self.create_bucket(bucket)
        root = Path(local_dir)
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            key = prefix + path.relative_to(root).as_posix()
            self.client.put_object(Bucket=bucket, Key=key, Body=path.read_bytes())


@dataclass(frozen=True)
class S3Server:
    endpoint_url: str
    client: Any  # one boto3 client per worker for arranging buckets (a new one parses botocore's JSON again)

    def reset(self) -> None:
        """Drop every bucket and object (moto's own reset API)."""
        req = urllib.request.Request(f"{self.endpoint_url}/moto-api/reset", method="POST")
        with urllib.request.urlopen(req, timeout=30) as resp:
            resp.read()


@pytest.fixture(scope="session")
def s3_server() -> Iterator[S3Server]:
    """moto's S3 server on 127.0.0.1 (port 0, read back), with dummy AWS credentials in the environment."""
    from moto.server import ThreadedMotoServer

    with pytest.MonkeyPatch.context() as mp:
        for name, value in _DUMMY_ENV.items():
            mp.setenv(name, value)
        mp.delenv("AWS_PROFILE", raising=False)
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.session.Session().client("s3", endpoint_url=endpoint,
                                                config=Config(s3={"addressing_style": "path"}))
        try:
            yield S3Server(endpoint, client)
        finally:
            client.close()
            server.stop()


@pytest.fixture
def s3(s3_server: S3Server) -> S3:
    """An empty S3 (moto reset before the test) and a client for arranging it."""
    s3_server.reset()
    return S3(s3_server.endpoint_url, s3_server.client)


@pytest.fixture
def fault_proxy(s3: S3) -> Iterator[FaultProxy]:
    """A FaultProxy in front of the (freshly reset) moto server; use its `endpoint_url` for the code under test."""
    with FaultProxy(s3.endpoint_url) as proxy:
        yield proxy
