"""The three object stores through the CLI and the daemon, configured by standard environment variables only:
Ceph radosgw (s3://), fake-gcs-server (gs://), Azurite (az://). Same model, bit-exact, same snapshot id from each;
an object that changes (shrinks) under a read restarts the fetch, which then publishes the new version (before,
gs:// ended in exit 6 `HttpError: , 416`)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.faultproxy import FaultProxy
from tests.fixtures_daemon import start_daemon
from tests_objstores.conftest import Bucket, wc
from weightcache.uri import parse_ref

STORES = ["s3", "gs", "az"]


def upload(store: str, local: Path, prefix: str, rgw_bucket: Bucket, gcs_bucket: tuple[str, Any],
           az_container: tuple[str, Any]) -> str:
    """The model under `prefix` of a fresh bucket of `store`; returns its reference."""
    files = sorted(p for p in local.rglob("*") if p.is_file())
    if store == "s3":
        rgw_bucket.upload_dir(local, prefix)
        return rgw_bucket.uri(prefix)
    name, fs = gcs_bucket if store == "gs" else az_container
    for path in files:
        fs.pipe(f"{name}/{prefix}{path.relative_to(local).as_posix()}", path.read_bytes())
    return f"{store}://{name}/{prefix}"


def put_one(store: str, ref: str, relpath: str, data: bytes, rgw_bucket: Bucket, gcs_bucket: tuple[str, Any],
            az_container: tuple[str, Any]) -> None:
    parsed = parse_ref(ref)
    if store == "s3":
        rgw_bucket.put(parsed.prefix + relpath, data)
    else:
        (gcs_bucket if store == "gs" else az_container)[1].pipe(f"{parsed.bucket}/{parsed.prefix}{relpath}", data)


def same_tree(a: Path, b: Path) -> None:
    names = sorted(p.relative_to(a).as_posix() for p in a.rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file())
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_prefetch_from_each_store_with_environment_variables_only(
        tiny_model: Path, rgw_bucket: Bucket, gcs_bucket: tuple[str, Any], az_container: tuple[str, Any],
        tier_env: Callable[..., dict[str, str]], tmp_path: Path) -> None:
    ids = {}
    for store in STORES:
        ref = upload(store, tiny_model, "tiny/", rgw_bucket, gcs_bucket, az_container)
        started = time.monotonic()
        done = wc("prefetch", ref, "--root", str(tmp_path / store), "-q", env=tier_env())
        print(f"{store}: prefetch {time.monotonic() - started:.1f} s")
        assert done.returncode == 0, done.stderr
        snap = Path(done.stdout.strip())
        same_tree(tiny_model, snap)
        ids[store] = snap.name
    assert len(set(ids.values())) == 1, ids


async def test_the_daemon_fetches_from_each_store(tiny_model: Path, rgw_bucket: Bucket, gcs_bucket: tuple[str, Any],
                                                  az_container: tuple[str, Any], short_dir: Path) -> None:
    refs = [upload(s, tiny_model, "d/", rgw_bucket, gcs_bucket, az_container) for s in STORES]
    daemon = await start_daemon(short_dir, tiny_model, env=dict(os.environ))
    try:
        snaps = [await asyncio.to_thread(daemon.client.ensure, ref) for ref in refs]
        metrics = await asyncio.to_thread(daemon.client.metrics)
    finally:
        await daemon.daemon.stop()
    assert len({s["id"] for s in snaps}) == 1
    same_tree(tiny_model, Path(snaps[0]["path"]))
    # each file checked against its store: radosgw's single-part MD5 ETags, fake-gcs-server's md5Hash, Azurite's
    # Content-MD5 (both listed); before, gs:// and az:// files were all `none`
    files = float(len(await asyncio.to_thread(lambda: [p for p in tiny_model.rglob("*") if p.is_file()])))
    published = {(s.labels["scheme"], s.labels["check"]): s.value for family in text_string_to_metric_families(metrics)
                 if family.name == "weightcache_published_files" for s in family.samples
                 if s.name.endswith("_total")}
    assert published == {("s3", "md5-etag"): files, ("gs", "md5"): files, ("az", "md5"): files}


# what a held download looks like on each store's wire: the object's own bytes, never its metadata or a listing
DOWNLOADS = {"s3": "/m/w.bin", "gs": "/download/", "az": "/m/w.bin"}


@pytest.mark.parametrize("store", STORES)
def test_an_object_that_shrinks_under_a_read_restarts_the_fetch(
        store: str, rgw_bucket: Bucket, gcs_bucket: tuple[str, Any], az_container: tuple[str, Any],
        tier_env: Callable[..., dict[str, str]], store_env: dict[str, str], tmp_path: Path) -> None:
    old, new = os.urandom(3 << 20), os.urandom(1 << 20)
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(old)
    ref = upload(store, src, "m/", rgw_bucket, gcs_bucket, az_container)
    origin = {"s3": store_env["AWS_ENDPOINT_URL"], "gs": store_env["STORAGE_EMULATOR_HOST"],
              "az": store_env["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[1].rsplit("/", 1)[0]}[store]
    with FaultProxy(origin) as proxy:
        hold = proxy.add("hold", method="GET", path=DOWNLOADS[store], count=1)
        env = tier_env(AWS_ENDPOINT_URL=proxy.endpoint_url, STORAGE_EMULATOR_HOST=proxy.endpoint_url,
                       AZURE_STORAGE_CONNECTION_STRING=store_env["AZURE_STORAGE_CONNECTION_STRING"].replace(
                           origin, proxy.endpoint_url))
        proc = subprocess.Popen([sys.executable, "-m", "weightcache", "prefetch", ref, "--root", str(tmp_path / "r"),
                                 "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        try:
            assert hold.arrived.wait(60), "the download never started"
            put_one(store, ref, "w.bin", new, rgw_bucket, gcs_bucket, az_container)  # smaller: a 416 unpinned
        finally:
            hold.release.set()
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "restarting fetch of" in err, err  # the documented restart, from a new listing
    assert (Path(out.strip()) / "w.bin").read_bytes() == new, "not the version listed after the restart"


@pytest.mark.parametrize("store", ["gs", "az"])
def test_a_bit_flipped_from_gs_or_az_fails_the_md5_their_listing_carries(
        store: str, gcs_bucket: tuple[str, Any], az_container: tuple[str, Any], rgw_bucket: Bucket,
        tier_env: Callable[..., dict[str, str]], store_env: dict[str, str], tmp_path: Path) -> None:
    """gs:// md5Hash and az:// Content-MD5 (set for a blob uploaded whole) check the downloaded bytes: a byte
    flipped in transit is refused (exit 7) where it was published before, with nothing recorded against it."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "w.bin").write_bytes(os.urandom(1 << 20))
    ref = upload(store, src, "m/", rgw_bucket, gcs_bucket, az_container)
    origin = {"gs": store_env["STORAGE_EMULATOR_HOST"],
              "az": store_env["AZURE_STORAGE_CONNECTION_STRING"].split("BlobEndpoint=")[1].rsplit("/", 1)[0]}[store]
    with FaultProxy(origin) as proxy:
        proxy.add("flip", method="GET", path=DOWNLOADS[store], at=1000, count=-1)
        env = tier_env(STORAGE_EMULATOR_HOST=proxy.endpoint_url,
                       AZURE_STORAGE_CONNECTION_STRING=store_env["AZURE_STORAGE_CONNECTION_STRING"].replace(
                           origin, proxy.endpoint_url))
        done = wc("prefetch", ref, "--root", str(tmp_path / "r"), "-q", env=env)
    assert done.returncode == 7, done.stderr
    assert "w.bin: md5" in done.stderr and "does not match" in done.stderr, done.stderr
    done = wc("prefetch", ref, "--root", str(tmp_path / "r"), "-q", env=tier_env())
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "w.bin").read_bytes() == (src / "w.bin").read_bytes()
    listed = wc("ls", "-o", "json", "--root", str(tmp_path / "r"), env=tier_env())
    assert json.loads(listed.stdout)[0]["source_checks"] == {"md5": 1}


def test_an_az_blob_committed_from_blocks_has_no_md5_and_says_so(
        az_container: tuple[str, Any], tier_env: Callable[..., dict[str, str]], tmp_path: Path) -> None:
    """adlfs uploads a large blob as blocks and sets no Content-MD5: nothing checks it (`none`, as
    requireSourceChecksum then refuses), not an MD5 taken from somewhere else."""
    name, fs = az_container
    data = os.urandom(9 << 20)
    with fs.open(f"{name}/m/big.bin", "wb", blocksize=4 << 20) as f:
        f.write(data)
    done = wc("prefetch", f"az://{name}/m/", "--root", str(tmp_path / "r"), "-q", env=tier_env())
    assert done.returncode == 0, done.stderr
    assert (Path(done.stdout.strip()) / "big.bin").read_bytes() == data
    assert json.loads(wc("ls", "-o", "json", "--root", str(tmp_path / "r"), env=tier_env()).stdout)[0][
        "source_checks"] == {"none": 1}
    strict = wc("prefetch", f"az://{name}/m/", "--root", str(tmp_path / "r2"), "-q",
                env=tier_env(WEIGHTCACHE_REQUIRE_SOURCE_CHECKSUM="true"))
    assert strict.returncode == 8 and "big.bin" in strict.stderr, strict.stderr
