"""Signed models (docs/signing.md): a model signed by the test with model_signing itself, fetched through the real
CLI from a real directory (file://) and, for the daemon's doors, through the fetch engine: a good signature
publishes and is recorded; a tampered file, a wrong key, a missing model.sig are exit 7 and nothing is published."""

from __future__ import annotations

import asyncio
import datetime
import hashlib
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import model_signing
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from tests.command import run_cli, weightcache
from tests.fake_apiserver import ApiError, FakeApiServer
from tests.fixtures_daemon import eventually, start_daemon
from tests.fixtures_kube import NODE
from tests.sample import make_model
from weightcache.access import ADMIN, Authority, Requester
from weightcache.dra.devices import devices_for
from weightcache.errors import SignatureError
from weightcache.fetch import Fetcher
from weightcache.fetch_queue import FetchQueue
from weightcache.signatures import key_fingerprint, make_policy
from weightcache.store import Snapshot, Store
from weightcache.uri import parse_ref, readiness_label


def _key_pair(directory: Path, name: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    private, public = directory / f"{name}.pem", directory / f"{name}.pub"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    public.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                     serialization.PublicFormat.SubjectPublicKeyInfo))
    return private, public


def _sign(model: Path, private: Path) -> None:
    """As `model_signing sign key MODEL --private_key KEY --signature MODEL/model.sig` does: model.sig beside the
    files, left out of what it signs."""
    model_signing.signing.Config().use_elliptic_key_signer(private_key=private).set_hashing_config(
        model_signing.hashing.Config().set_ignored_paths(paths=["model.sig"])).sign(model, model / "model.sig")


@pytest.fixture
def signed(tmp_path: Path) -> tuple[Path, Path]:
    """A real safetensors model signed with a fresh key: (model dir, public key)."""
    model = tmp_path / "model"
    make_model(model, layers=1, hidden=64, shards=2)
    private, public = _key_pair(tmp_path, "key")
    _sign(model, private)
    return model, public


Cli = Callable[..., tuple[int, str, str]]


@pytest.fixture
def cli(capfd: pytest.CaptureFixture[str]) -> Cli:
    """The `weightcache` command in this process (cli.main): model_signing is imported once, not per command."""
    return lambda *argv: run_cli(capfd, *argv)


def _prefetch(cli: Cli, root: Path, model: Path, *flags: str) -> tuple[int, str, str]:
    return cli("prefetch", f"file://{model}/", "--root", str(root), "--no-daemon", "-q", "-o", "json", *flags)


def _listed(cli: Cli, root: Path) -> list[dict[str, Any]]:
    code, out, err = cli("ls", "--root", str(root), "--no-daemon", "-o", "json")
    assert code in (0, 3), err
    return json.loads(out or "[]") if code == 0 else []


def test_a_good_signature_publishes_and_is_recorded_in_ls_and_verify(tmp_path: Path,
                                                                     signed: tuple[Path, Path],
                                                                     cli: Cli) -> None:
    model, public = signed
    code, out, err = _prefetch(cli, tmp_path / "root", model, "--signed-by", str(public))
    assert code == 0, err
    snap = json.loads(out)
    [entry] = _listed(cli, tmp_path / "root")
    record = entry["signature"]
    assert record == {"method": "key", "signer": key_fingerprint(public.read_text()),
                      "bundle_sha256": hashlib.sha256((model / "model.sig").read_bytes()).hexdigest(),
                      "files": len(list(model.iterdir())) - 1}
    assert (Path(snap["path"]) / "model.sig").is_file()  # the pod can check it again itself
    code, out, err = cli("verify", "--root", str(tmp_path / "root"), "--no-daemon", "-o", "json")
    assert code == 0, err
    assert json.loads(out)["snapshots"][0]["signature"] == record
    code, out, _ = cli("verify", "--root", str(tmp_path / "root"), "--no-daemon")
    assert f"signed by key {record['signer']}" in out


@pytest.mark.parametrize("wrong", ["tampered", "wrong-key", "missing", "unsigned-file", "garbage"])
def test_a_bad_or_missing_signature_is_exit_7_and_nothing_is_published(tmp_path: Path, signed: tuple[Path, Path],
                                                                        wrong: str, cli: Cli) -> None:
    model, public = signed
    accepted = public
    if wrong == "tampered":  # one byte of a shard changed after signing, size kept
        shard = next(model.glob("*.safetensors"))
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        shard.write_bytes(bytes(data))
    elif wrong == "wrong-key":
        accepted = _key_pair(tmp_path, "other")[1]
    elif wrong == "missing":
        (model / "model.sig").unlink()
    elif wrong == "unsigned-file":  # a file added after signing
        (model / "extra.py").write_text("import os\n")
    else:
        (model / "model.sig").write_text('{"mediaType": "nonsense"}')
    code, out, err = _prefetch(cli, tmp_path / "root", model, "--signed-by", str(accepted))
    assert code == 7, (out, err)
    expected = {"tampered": r"has sha256 .*, the signature says", "wrong-key": r"not among the 1 key\(s\) accepted",
                "missing": r"has no model.sig .*; sign it \(model_signing sign key",
                "unsigned-file": "extra.py is not signed", "garbage": "not a model_signing bundle"}[wrong]
    assert re.search(expected, err), err
    assert "Traceback" not in err
    assert _listed(cli, tmp_path / "root") == []  # nothing published


def test_the_command_says_why_with_exit_7_and_no_traceback(tmp_path: Path, signed: tuple[Path, Path]) -> None:
    """The real command, as a user runs it (a child process)."""
    model, public = signed
    (model / "model.sig").unlink()
    proc = weightcache("prefetch", f"file://{model}/", "--root", str(tmp_path / "root"), "--signed-by", str(public))
    assert proc.returncode == 7, proc.stderr
    assert "has no model.sig" in proc.stderr and "Traceback" not in proc.stderr
    assert not list((tmp_path / "root" / "manifests").iterdir())


def test_key_rotation_accepts_any_configured_key_and_allow_unsigned_publishes_unsigned(
        tmp_path: Path, signed: tuple[Path, Path], cli: Cli) -> None:
    model, public = signed
    old = _key_pair(tmp_path, "old")[1]
    code, _, err = _prefetch(cli, tmp_path / "root", model, "--signed-by", str(old), "--signed-by", str(public))
    assert code == 0, err
    [entry] = _listed(cli, tmp_path / "root")
    assert entry["signature"]["signer"] == key_fingerprint(public.read_text())

    unsigned = tmp_path / "unsigned"
    make_model(unsigned, layers=1, hidden=32, shards=1)
    code, _, err = _prefetch(cli, tmp_path / "root2", unsigned, "--signed-by", str(public), "--allow-unsigned")
    assert code == 0, err
    [entry] = _listed(cli, tmp_path / "root2")
    assert entry["signature"]["method"] == "unsigned"
    # allowUnsigned never lets a bad signature through
    (unsigned / "model.sig").write_text("{}")
    code, _, err = _prefetch(cli, tmp_path / "root3", unsigned, "--signed-by", str(public), "--allow-unsigned")
    assert code == 7, err


def test_a_bad_key_file_is_exit_2(tmp_path: Path, signed: tuple[Path, Path], cli: Cli) -> None:
    model, _ = signed
    (tmp_path / "bad.pub").write_text("not a key")
    code, _, err = _prefetch(cli, tmp_path / "root", model, "--signed-by", str(tmp_path / "bad.pub"))
    assert code == 2, err
    assert "is not a PEM public key" in err


def test_a_cache_hit_is_checked_too_and_the_record_added(tmp_path: Path, signed: tuple[Path, Path]) -> None:
    """A snapshot published for a request that asked no signature is checked when a later request asks one (from
    its recorded digests and its model.sig blob), and refused when it does not satisfy it."""
    model, public = signed
    store = Store(tmp_path / "root")
    fetcher = Fetcher(store)
    ref = parse_ref(f"file://{model}/")
    snap = fetcher.ensure(Authority().authorize(ref, ADMIN))
    assert store.signature(snap.id) == {}
    other = make_policy(keys=[_key_pair(tmp_path, "other")[1].read_text()])
    with pytest.raises(SignatureError, match="not among"):
        fetcher.ensure(Authority().authorize(ref, ADMIN, signed_by=other))
    with pytest.raises(SignatureError, match="not among"):
        fetcher.lookup(Authority().authorize(ref, ADMIN, signed_by=other))
    good = make_policy(keys=[public.read_text()])
    assert fetcher.ensure(Authority().authorize(ref, ADMIN, signed_by=good)).id == snap.id
    assert store.signature(snap.id)["signer"] == key_fingerprint(public.read_text())


def _ca(directory: Path) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "test model CA")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    (directory / "ca.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key, cert


def _leaf(directory: Path, ca: tuple[ec.EllipticCurvePrivateKey, x509.Certificate], email: str) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, email)]))
            .issuer_name(ca[1].subject).public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.RFC822Name(email)]), critical=False)
            .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                         crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(ca[0], hashes.SHA256()))
    private, certificate = directory / f"{email}.key", directory / f"{email}.crt"
    private.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    certificate.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return private, certificate


def test_a_certificate_signature_verifies_offline_against_the_ca_and_identity(tmp_path: Path) -> None:
    """`model_signing sign certificate`: the chain is checked against the admin's CA and the leaf's SAN against
    the identities, with the network unreachable (no socket may be opened while verifying)."""
    model = tmp_path / "model"
    make_model(model, layers=1, hidden=32, shards=1)
    ca = _ca(tmp_path)
    private, cert = _leaf(tmp_path, ca, "release@example.com")
    model_signing.signing.Config().use_certificate_signer(
        private_key=private, signing_certificate=cert, certificate_chain=[tmp_path / "ca.pem"]).set_hashing_config(
        model_signing.hashing.Config().set_ignored_paths(paths=["model.sig"])).sign(model, model / "model.sig")
    fetcher = Fetcher(Store(tmp_path / "root"))
    ref = parse_ref(f"file://{model}/")
    ca_pem = (tmp_path / "ca.pem").read_text()

    def no_network(*args: object, **kwargs: object) -> socket.socket:
        raise AssertionError("verifying a signature opened a socket")

    real = socket.socket
    socket.socket = no_network  # type: ignore[assignment,misc]
    try:
        wrong = make_policy(ca_certificates=[ca_pem], identities=["someone@example.com"])
        with pytest.raises(SignatureError, match=r"release@example\.com"):
            fetcher.ensure(Authority().authorize(ref, ADMIN, signed_by=wrong))
        assert fetcher.store.list() == []
        good = make_policy(ca_certificates=[ca_pem], identities=["release@example.com"])
        snap = fetcher.ensure(Authority().authorize(ref, ADMIN, signed_by=good))
    finally:
        socket.socket = real  # type: ignore[misc]
    assert fetcher.store.signature(snap.id)["signer"] == "release@example.com"
    assert fetcher.store.signature(snap.id)["method"] == "certificate"
    (tmp_path / "other").mkdir()
    _ca(tmp_path / "other")  # a CA that did not issue the signing certificate
    other = make_policy(ca_certificates=[(tmp_path / "other" / "ca.pem").read_text()])
    with pytest.raises(SignatureError, match="certificate"):
        Fetcher(Store(tmp_path / "root2")).ensure(Authority().authorize(ref, ADMIN, signed_by=other))


async def test_a_modelcache_with_spec_signature_refuses_with_the_reason_in_status_and_an_event(
        cluster: FakeApiServer, short_dir: Path, tmp_path: Path, signed: tuple[Path, Path]) -> None:
    """Through the stand-in API server (CRD schema enforced): spec.signature naming the wrong key -> the node's
    status says Failed and why, with a FetchFailed Event, and nothing is published or labelled; the right key
    (rotation: the old key stays listed) -> Ready, the record in the node's store."""
    model, public = signed
    uri = f"file://{model}/"
    other = _key_pair(tmp_path, "other")[1].read_text()
    cluster.create("modelcaches", {"metadata": {"name": "signed"}, "spec": {
        "source": uri, "nodeSelector": {"pool": "a100"}, "allowedNamespaces": ["team-a"],
        "signature": {"publicKeys": [other]}}})
    assert cluster.get("modelcaches", "signed")["spec"]["signature"]["publicKeys"] == [other]  # in the schema
    d = await start_daemon(short_dir, model, env={"NODE_NAME": NODE})

    def state() -> dict[str, Any] | None:
        try:
            return cluster.get("modelcachenodes", NODE)["status"]["models"]["signed"]
        except (KeyError, ApiError):
            return None

    try:
        failed = await eventually(lambda: (s := state()) and s["phase"] == "Failed" and s, what="Failed", timeout=60)
        assert "model.sig does not verify" in failed["message"] and "ModelCache signed" in failed["message"]
        def refusals() -> list[dict[str, Any]]:  # the daemon's other Events (its node's) may come first
            return [e for e in cluster.list("events", "default") if e.get("reason") == "FetchFailed"
                    and "model.sig does not verify" in e.get("message", "")]
        [event] = await eventually(refusals, what="a FetchFailed Event saying why", timeout=60)
        assert event["involvedObject"]["name"] == "signed"
        assert d.daemon.node.store.list() == []
        assert readiness_label(uri) not in cluster.get("nodes", NODE)["metadata"].get("labels", {})

        mc = cluster.get("modelcaches", "signed")
        mc["spec"]["signature"]["publicKeys"] = [other, public.read_text()]
        cluster.update("modelcaches", "signed", mc)

        def keys_seen() -> bool:  # the daemon's watch has the new spec: the next pass decides with it
            return any(len(((m.get("spec") or {}).get("signature") or {}).get("publicKeys") or []) == 2
                       for m in d.daemon.node.authority.model_caches())
        await eventually(keys_seen, what="the daemon to see the rotated keys", timeout=60)
        d.daemon.node.kick()
        await eventually(lambda: (s := state()) and s["phase"] == "Ready", what="Ready, rotated", timeout=60)
        (info,) = d.daemon.node.store.list()
        assert info.signature["signer"] == key_fingerprint(public.read_text())
    finally:
        await d.daemon.stop()


def test_a_signed_snapshot_is_a_dra_device_with_signed_and_signer(tmp_path: Path, signed: tuple[Path, Path]) -> None:
    """What verified a snapshot is offered to pods as device attributes a claim's CEL selector can require
    (`device.attributes["models.weightcache.io"].signed`), beside model.sig in the volume itself."""
    model, public = signed
    store = Store(tmp_path / "root")
    good = make_policy(keys=[public.read_text()])
    snap = Fetcher(store).ensure(Authority().authorize(parse_ref(f"file://{model}/"), ADMIN, signed_by=good))
    [info] = store.list()
    [device] = devices_for([info.snapshot], slots=1, shared=False,
                           signatures={i.snapshot.id: i.signature for i in store.list()})
    assert device["attributes"]["signed"] == {"bool": True}
    assert device["attributes"]["signer"] == {"string": key_fingerprint(public.read_text())}
    [plain] = devices_for([snap], slots=1, shared=False)
    assert plain["attributes"]["signed"] == {"bool": False} and "signer" not in plain["attributes"]


async def test_prefetch_signed_by_through_the_daemon(short_dir: Path, tmp_path: Path,
                                                     signed: tuple[Path, Path]) -> None:
    """The CLI sends the key's contents to the daemon (the ensure body's `signature`, spec.signature's shape):
    the wrong key is exit 7 from the daemon's fetch with nothing published; the right one publishes and records."""
    model, public = signed
    d = await start_daemon(short_dir, model)
    env = {**{k: v for k, v in os.environ.items() if k not in ("WEIGHTCACHE_ROOT", "KUBECONFIG")},
           "WEIGHTCACHE_SOCKET": str(d.socket), "KUBECONFIG": "/nonexistent"}
    other = _key_pair(tmp_path, "other")[1]
    try:
        wrong = await asyncio.to_thread(weightcache, "prefetch", d.model_uri, "--signed-by", str(other), "-q", env=env)
        assert wrong.returncode == 7, wrong.stderr
        assert "not among the 1 key(s) accepted" in wrong.stderr and "Traceback" not in wrong.stderr
        assert d.daemon.node.store.list() == []
        bad = {"uri": d.model_uri, "signature": {"publicKeys": ["x"]}}  # the request's fault: 400, named
        async with d.http() as http, http.put("/v1/models", json=bad) as r:
            assert r.status == 400 and "is not a PEM public key" in (await r.json())["message"]
        good = await asyncio.to_thread(weightcache, "prefetch", d.model_uri, "--signed-by", str(public), "-q",
                                       "-o", "json", env=env)
        assert good.returncode == 0, good.stderr
        listed = await asyncio.to_thread(weightcache, "ls", "-o", "json", env=env)
        assert json.loads(listed.stdout)[0]["signature"]["signer"] == key_fingerprint(public.read_text())
    finally:
        await d.daemon.stop()


def _damage(snapshot: Path) -> None:
    victim = snapshot / "config.json"
    os.chmod(victim, 0o644)
    victim.write_text('{"damaged": true}\n')


def test_repair_refetches_under_the_requirement_the_snapshot_was_published_with(
        tmp_path: Path, signed: tuple[Path, Path], cli: Cli) -> None:
    """`verify --repair` (no daemon) refetches under the snapshot's recorded signature: the repaired snapshot keeps
    its record, and a source whose files no longer match what model.sig signs is refused with exit 7."""
    model, public = signed
    root = tmp_path / "root"
    code, out, err = _prefetch(cli, root, model, "--signed-by", str(public))
    assert code == 0, err
    snap = json.loads(out)
    [before] = _listed(cli, root)
    _damage(Path(snap["path"]))
    code, out, err = cli("verify", "--repair", "--root", str(root), "--no-daemon")
    assert code == 0 and "repaired" in out, out + err
    [after] = _listed(cli, root)
    assert after["id"] == before["id"] and after["signature"] == before["signature"]
    assert after["signature"]["method"] == "key"
    _damage(Path(snap["path"]))
    (model / "config.json").write_text('{"tampered": true}\n')  # the source changed, model.sig did not
    code, out, err = cli("verify", "--repair", "--root", str(root), "--no-daemon")
    assert code == 7 and "model.sig" in err, err
    assert "Traceback" not in err
    assert _listed(cli, root) == []


async def test_repair_through_the_daemon_keeps_the_signature_record(short_dir: Path,
                                                                   signed: tuple[Path, Path]) -> None:
    """The daemon's verify --repair refetches under the recorded requirement too (the grant it asks
    node.authorize for carries it), and a tampered source is exit 7."""
    model, public = signed
    d = await start_daemon(short_dir, model)
    env = {**{k: v for k, v in os.environ.items() if k not in ("WEIGHTCACHE_ROOT", "KUBECONFIG")},
           "WEIGHTCACHE_SOCKET": str(d.socket), "KUBECONFIG": "/nonexistent"}
    try:
        done = await asyncio.to_thread(weightcache, "prefetch", d.model_uri, "--signed-by", str(public), "-q",
                                       "-o", "json", env=env)
        assert done.returncode == 0, done.stderr
        snap = json.loads(done.stdout)
        record = d.daemon.node.store.signature(snap["id"])
        assert record["method"] == "key"
        _damage(Path(snap["path"]))
        done = await asyncio.to_thread(weightcache, "verify", "--repair", env=env)
        assert done.returncode == 0 and "repaired" in done.stdout, done.stdout + done.stderr
        assert d.daemon.node.store.signature(snap["id"]) == record
        _damage(Path(snap["path"]))
        (model / "config.json").write_text('{"tampered": true}\n')
        done = await asyncio.to_thread(weightcache, "verify", "--repair", env=env)
        assert done.returncode == 7 and "Traceback" not in done.stderr, done.stderr
        assert d.daemon.node.store.list() == []
    finally:
        await d.daemon.stop()


def test_a_model_signed_by_the_librarys_own_cli_verifies_and_a_deleted_file_is_refused(
        tmp_path: Path, cli: Cli) -> None:
    """`model_signing sign key DIR --private_key KEY --signature DIR/model.sig`, as docs/signing.md says to run it
    (its manifest leaves out model.sig and the git files by name)."""
    model = tmp_path / "model"
    make_model(model, layers=1, hidden=32, shards=2)
    (model / ".gitattributes").write_text("*.safetensors filter=lfs\n")  # left out by the signer, and by us
    private, public = _key_pair(tmp_path, "key")
    proc = subprocess.run([sys.executable, "-m", "model_signing", "sign", "key", str(model), "--private_key",
                           str(private), "--signature", str(model / "model.sig")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    code, _, err = _prefetch(cli, tmp_path / "root", model, "--signed-by", str(public))
    assert code == 0, err
    next(model.glob("*.safetensors")).unlink()
    code, _, err = _prefetch(cli, tmp_path / "root2", model, "--signed-by", str(public))
    assert code == 7 and "is signed but missing" in err, err


def test_globs_that_leave_out_model_sig_say_so_and_globs_that_keep_it_verify_a_subset(
        tmp_path: Path, signed: tuple[Path, Path], cli: Cli) -> None:
    model, public = signed
    code, _, err = _prefetch(cli, tmp_path / "root", model, "--signed-by", str(public), "--include", "*.safetensors")
    assert code == 7 and "add --include model.sig" in err, err
    code, _, err = _prefetch(cli, tmp_path / "root", model, "--signed-by", str(public), "--include", "*.safetensors",
                             "--include", "model.sig")
    assert code == 0, err  # the signed files the globs leave out may be missing; those fetched must match


async def test_callers_with_other_requirements_never_share_one_fetch(tmp_path: Path,
                                                                      signed: tuple[Path, Path]) -> None:
    """The daemon's fetch queue: three callers at once for one model, one requiring nothing, one the wrong key, one
    the right key and streaming its files. They run one after the other (the model's lock); the wrong key is
    refused, and the streaming caller hears of no file before model.sig verified the whole model."""
    model, public = signed
    store = Store(tmp_path / "root")
    queue = FetchQueue(Fetcher(store))
    ref = parse_ref(f"file://{model}/")
    authority = Authority()
    wrong = make_policy(keys=[_key_pair(tmp_path, "other")[1].read_text()])
    seen: list[bool] = []  # per file handed over: was the snapshot already published (so checked)?
    try:
        plain, refused, streamed = await asyncio.gather(
            queue.fetch(authority.authorize(ref, ADMIN), keep=True),
            queue.fetch(authority.authorize(ref, ADMIN, signed_by=wrong)),
            queue.fetch(authority.authorize(ref, ADMIN, signed_by=make_policy(keys=[public.read_text()])),
                        on_file=lambda durable: seen.append(bool(store.list()))),
            return_exceptions=True)
    finally:
        queue.close()
    assert isinstance(refused, SignatureError), refused
    assert isinstance(plain, Snapshot) and isinstance(streamed, Snapshot) and plain.id == streamed.id
    assert seen and all(seen), seen


def test_a_malformed_spec_signature_fails_closed_for_every_door(tmp_path: Path, signed: tuple[Path, Path]) -> None:
    """A ModelCache whose spec.signature cannot be read refuses the model (it is never fetched as if nothing were
    asked); a namespace's grant carries the ModelCache's requirement like the admin's."""
    model, public = signed
    uri = f"file://{model}/"
    caches = [{"metadata": {"name": "broken"}, "spec": {"source": uri, "allowedNamespaces": ["team-a"],
                                                         "signature": {"publicKeys": ["not a key"]}}}]
    authority = Authority(model_caches=lambda: caches, allow_undeclared=lambda: False)
    fetcher = Fetcher(Store(tmp_path / "root"))
    with pytest.raises(SignatureError, match=r"ModelCache broken is invalid .*not a PEM public key"):
        fetcher.ensure(authority.authorize(parse_ref(uri), Requester("team-a")))
    assert fetcher.store.list() == []
    caches[0]["spec"]["signature"] = {"publicKeys": [public.read_text()]}
    grant = authority.authorize(parse_ref(uri), Requester("team-a"))
    assert [p.source for p in grant.signatures] == ["ModelCache broken"]
    assert fetcher.store.signature(fetcher.ensure(grant).id)["method"] == "key"
