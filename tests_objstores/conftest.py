"""The object-store tier's fixtures: each server started once per run (session scope), a fresh bucket per test.

    def test_x(rgw_bucket, tier_env):
        rgw_bucket.put("llama/config.json", b"{}")
        wc("prefetch", rgw_bucket.uri("llama/"), env=tier_env(rgw=True))

`tier_env(...)` is the environment a user sets, and nothing else: AWS_* for radosgw, STORAGE_EMULATOR_HOST for
fake-gcs-server, AZURE_STORAGE_CONNECTION_STRING for Azurite.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import boto3
import pytest
from botocore.config import Config

from tests_objstores import servers

pytest_plugins = ["tests.fixtures_daemon"]  # tiny_model, short_dir, daemon; autouse off_cluster

T = TypeVar("T")
TIMINGS: dict[str, float] = {}  # server -> seconds to start, printed at the end (README's tier figures)


@pytest.fixture(scope="session")
def tier_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="wc-tier-"))
    yield path
    subprocess.run(["rm", "-rf", str(path)], check=False)


def _started(name: str, cm: AbstractContextManager[T]) -> Iterator[T]:
    """A session fixture's body: start the server (timed, for the summary line), yield it, stop it."""
    started = time.monotonic()
    with cm as value:
        TIMINGS[name] = time.monotonic() - started
        yield value


@pytest.fixture(scope="session")
def rgw(tier_dir: Path) -> Iterator[servers.Rgw]:
    yield from _started("radosgw", servers.ceph_rgw(tier_dir / "ceph"))


@pytest.fixture(scope="session")
def gcs_url(tier_dir: Path) -> Iterator[str]:
    yield from _started("fake-gcs-server", servers.fake_gcs(tier_dir / "gcs"))


@pytest.fixture(scope="session")
def azurite_conn(tier_dir: Path) -> Iterator[str]:
    yield from _started("azurite", servers.azurite(tier_dir / "azurite"))


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if TIMINGS:
        terminalreporter.write_line("object-store tier start: " + ", ".join(f"{k} {v:.1f} s"
                                                                             for k, v in TIMINGS.items()))


# -- S3 on radosgw ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Bucket:
    """A fresh bucket on radosgw and a boto3 client (path-style, signed with the tier's user) to arrange it."""

    name: str
    client: Any
    endpoint_url: str

    def uri(self, prefix: str) -> str:
        return f"s3://{self.name}/{prefix}"

    def put(self, key: str, data: bytes, **extra: Any) -> dict[str, Any]:
        return dict(self.client.put_object(Bucket=self.name, Key=key, Body=data, **extra))

    def put_multipart(self, key: str, parts: list[bytes]) -> dict[str, Any]:
        """One multipart upload of these parts (S3: each but the last at least 5 MiB), no checksum asked for."""
        up = self.client.create_multipart_upload(Bucket=self.name, Key=key)
        done = []
        for n, data in enumerate(parts, 1):
            r = self.client.upload_part(Bucket=self.name, Key=key, UploadId=up["UploadId"], PartNumber=n, Body=data)
            done.append({"PartNumber": n, "ETag": r["ETag"]})
        return dict(self.client.complete_multipart_upload(Bucket=self.name, Key=key, UploadId=up["UploadId"],
                                                          MultipartUpload={"Parts": done}))

    def upload_dir(self, local: Path, prefix: str) -> None:
        for path in sorted(p for p in local.rglob("*") if p.is_file()):
            self.put(prefix + path.relative_to(local).as_posix(), path.read_bytes())


@pytest.fixture(scope="session")
def rgw_client(rgw: servers.Rgw) -> Iterator[Any]:
    client = boto3.session.Session(aws_access_key_id=rgw.access_key, aws_secret_access_key=rgw.secret_key,
                                   region_name="us-east-1").client(
        "s3", endpoint_url=rgw.endpoint_url, config=Config(s3={"addressing_style": "path"}))
    yield client
    client.close()


@pytest.fixture
def rgw_bucket(rgw: servers.Rgw, rgw_client: Any) -> Bucket:
    name = f"t-{uuid.uuid4().hex[:12]}"
    rgw_client.create_bucket(Bucket=name)
    return Bucket(name, rgw_client, rgw.endpoint_url)


# -- gs:// on fake-gcs-server, az:// on Azurite ------------------------------------------------------------------
@pytest.fixture(scope="session")
def store_env(rgw: servers.Rgw, gcs_url: str, azurite_conn: str) -> dict[str, str]:
    """The standard variables a user of all three stores sets (and nothing of weightcache's)."""
    return {
        "AWS_ENDPOINT_URL": rgw.endpoint_url, "AWS_ACCESS_KEY_ID": rgw.access_key,
        "AWS_SECRET_ACCESS_KEY": rgw.secret_key, "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "STORAGE_EMULATOR_HOST": gcs_url, "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false",
        "AZURE_STORAGE_CONNECTION_STRING": azurite_conn,
    }


@pytest.fixture(scope="session", autouse=True)
def _in_process_env(store_env: dict[str, str]) -> Iterator[None]:
    """The same variables in this process, for sources opened in-process (gcsfs and adlfs read them)."""
    with pytest.MonkeyPatch.context() as mp:
        for name in [k for k in os.environ if k.startswith("AWS_")]:
            mp.delenv(name)
        for name, value in store_env.items():
            mp.setenv(name, value)
        yield


@pytest.fixture
def gcs_bucket(gcs_url: str) -> Iterator[tuple[str, Any]]:
    """A fresh gs:// bucket and a gcsfs filesystem (not fsspec's cached instance) to arrange it."""
    import gcsfs

    fs = gcsfs.GCSFileSystem(token="anon", skip_instance_cache=True)
    name = f"t-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield name, fs


@pytest.fixture
def az_container(azurite_conn: str) -> Iterator[tuple[str, Any]]:
    """A fresh az:// container and an adlfs filesystem to arrange it."""
    import adlfs

    fs = adlfs.AzureBlobFileSystem(connection_string=azurite_conn, skip_instance_cache=True)
    name = f"t-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield name, fs


@pytest.fixture
def tier_env(store_env: dict[str, str], tmp_path: Path) -> Callable[..., dict[str, str]]:
    """The environment of a user of all three stores: only standard variables, no weightcache flag."""
    def make(**extra: str) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("AWS_", "WEIGHTCACHE_", "AZURE_", "STORAGE_EMULATOR", "GCSFS_"))}
        env.update({"KUBECONFIG": "/nonexistent", "HOME": str(tmp_path / "home"),
                    "WEIGHTCACHE_SOCKET": "/nonexistent/wc.sock", **store_env})
        env.update(extra)
        return env
    return make


def wc(*args: str, env: dict[str, str], timeout: float = 180) -> subprocess.CompletedProcess[str]:
    """The CLI as a user runs it."""
    return subprocess.run([sys.executable, "-m", "weightcache", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)

