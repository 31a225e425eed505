"""Signed models: OpenSSF model-signing bundles (`model.sig`) checked once per node, at fetch, before publish.

A model signed with the `model_signing` library or its CLI carries `model.sig` beside its files: a Sigstore bundle
whose DSSE envelope holds an in-toto statement listing every file's sha256 (the signature file itself and the git
files left out, as the signer leaves them out). The fetch engine has already computed every file's sha256 while the
bytes arrived, so the check here never reads a model file again:

    model.sig (one small blob) --verify the envelope's signature against the admin's keys or CA--> signed manifest
    signed manifest (path -> sha256)  ==  the fetch's own digests (path -> sha256)     else SignatureError, exit 7

Only what verifies offline is accepted: elliptic-curve public keys (`publicKeys`, any one of several: rotation)
and certificate chains to the admin's CA certificates (`caCertificates`, optionally pinned to the signing
certificate's identities, `certificateIdentities`). Nothing here opens a socket: keyless Sigstore bundles (Fulcio
certificates, Rekor entries) would need the public-good trust root and are refused with that reason
(docs/signing.md). `model_signing` is imported only here (a protected contract in pyproject.toml), and only when a
signature is asked for: it takes about a second to import.
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from weightcache.errors import ConfigError, SignatureError

SIGNATURE_FILE = "model.sig"  # where model_signing's CLI writes the bundle, and where we look for it
MAX_BUNDLE_BYTES = 64 << 20  # a bundle lists each file once (~150 bytes): 64 MiB is ~400,000 files
GIT_PATHS = (".git/", ".gitattributes", ".github/", ".gitignore")  # model_signing leaves these out by default
_DIFFS_SHOWN = 5


@dataclass(frozen=True)
class SignaturePolicy:
    """Who may have signed a model (any one of them), as an admin configured it: `spec.signature` of a ModelCache,
    or `weightcache prefetch --signed-by`. `source` names where it came from, for messages."""

    keys: tuple[str, ...] = ()  # PEM public keys (EC P-256/P-384/P-521)
    ca_certificates: tuple[str, ...] = ()  # PEM CA certificates a signing certificate must chain to
    identities: tuple[str, ...] = ()  # with ca_certificates: the signing certificate's SAN must be one of these
    allow_unsigned: bool = False  # a model without model.sig is published (recorded unsigned); a bad one never
    source: str = field(default="the request", compare=False)
    invalid: str = ""  # why the configured policy could not be read: every model it covers is refused
    # (method, signer, bundle sha256) of a snapshot's record (recorded_policy): only that very model.sig is accepted
    recorded: tuple[str, ...] = ()

    def describe(self) -> str:
        if self.recorded:
            method, signer, bundle = self.recorded
            return f"the {method} signature {signer[:12]} (model.sig {bundle[:12]}) it was published with"
        parts = [f"key {key_fingerprint(k)[:12]}" for k in self.keys]
        if self.ca_certificates:
            who = f" for {', '.join(self.identities)}" if self.identities else ""
            parts.append(f"a certificate from {len(self.ca_certificates)} CA certificate(s){who}")
        return " or ".join(parts) or "nobody"


@dataclass(frozen=True)
class SignatureRecord:
    """What verified a snapshot: recorded in its manifest, shown by `ls -o json` and `verify`, offered to pods."""

    method: str  # "key", "certificate", or "unsigned" (allowed by an allowUnsigned policy)
    signer: str  # sha256 hex of the key's PEM (model_signing's own key hint), or the certificate's identity
    bundle_sha256: str  # of model.sig ("" when unsigned)
    files: int  # files the signature covers

    def to_json(self) -> dict[str, str | int]:
        return {"method": self.method, "signer": self.signer, "bundle_sha256": self.bundle_sha256,
                "files": self.files}


def key_fingerprint(pem: str) -> str:
    """The sha256 hex of a public key's PEM, as model_signing writes it into a bundle's key hint (so the bundle
    says which key signed it); for a key file written by `cryptography` or openssl it is `sha256sum key.pub`. 64
    characters: it fits a DRA device attribute whole."""
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_public_key(pem.encode())
    canonical = key.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(canonical).hexdigest()


def policy_from_spec(spec: object, *, source: str) -> SignaturePolicy:
    """A ModelCache's `spec.signature`. Malformed, it is returned with `invalid` set: the model is refused (fail
    closed), never fetched as if nothing were asked."""
    try:
        return parse_policy(spec, source=source)
    except ConfigError as exc:
        return SignaturePolicy(source=source, invalid=str(exc))


def parse_policy(spec: object, *, source: str) -> SignaturePolicy:
    """A signature requirement written as `spec.signature` is (the API's ensure body and the CLI send the same
    shape): `{publicKeys: [PEM], caCertificates: [PEM], certificateIdentities: [str], allowUnsigned: bool}`.
    ConfigError (exit 2) naming what is wrong."""
    try:
        text = json.dumps(spec, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{source}: spec.signature is not JSON data ({exc})") from None
    return _parse_spec(text, source)


@functools.lru_cache(maxsize=64)  # authorize runs per CSI publish and per reconcile: PEMs are parsed once
def _parse_spec(text: str, source: str) -> SignaturePolicy:
    spec = json.loads(text)
    if not isinstance(spec, dict):
        raise ConfigError(f"{source}: spec.signature must be an object")
    known = {"publicKeys", "caCertificates", "certificateIdentities", "allowUnsigned"}
    if unknown := sorted(set(spec) - known):
        raise ConfigError(f"{source}: spec.signature has unknown fields {unknown}; known: {sorted(known)}")
    allow = spec.get("allowUnsigned", False)
    if not isinstance(allow, bool):
        raise ConfigError(f"{source}: spec.signature.allowUnsigned must be true or false")
    return make_policy(keys=_strings(spec, "publicKeys", source),
                       ca_certificates=_strings(spec, "caCertificates", source),
                       identities=_strings(spec, "certificateIdentities", source), allow_unsigned=allow,
                       source=source)


def recorded_policy(record: Mapping[str, str | int], snapshot_id: str) -> SignaturePolicy | None:
    """The requirement a snapshot was published under, from its signature record (None when none was asked), for
    `verify --repair`'s refetch. The keys are not kept on the node, but the record names the model.sig that
    verified (its sha256): that very bundle verifies the same again, so it is pinned and its signed file list
    compared with the refetched files as always; a different or missing model.sig is refused (exit 7)."""
    method, signer, bundle = (str(record.get(k, "")) for k in ("method", "signer", "bundle_sha256"))
    if not method:
        return None
    return SignaturePolicy(allow_unsigned=method == "unsigned", recorded=(method, signer, bundle),
                           source=f"snapshot {snapshot_id[:12]}'s signature record")


def _strings(spec: Mapping[str, Any], name: str, source: str) -> tuple[str, ...]:
    value = spec.get(name, [])
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ConfigError(f"{source}: spec.signature.{name} must be a list of strings")
    return tuple(value)


def make_policy(*, keys: Iterable[str] = (), ca_certificates: Iterable[str] = (), identities: Iterable[str] = (),
                allow_unsigned: bool = False, source: str = "the request") -> SignaturePolicy:
    """A policy whose keys and certificates are checked now (ConfigError naming the bad one), not at fetch."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    keys, cas, identities = tuple(keys), tuple(ca_certificates), tuple(identities)
    for i, pem in enumerate(keys):
        try:
            key = serialization.load_pem_public_key(pem.encode())
        except ValueError as exc:
            raise ConfigError(f"{source}: public key {i + 1} is not a PEM public key ({exc})") from None
        if not isinstance(key, ec.EllipticCurvePublicKey) or key.curve.name not in _CURVES:
            raise ConfigError(f"{source}: public key {i + 1} is not an EC P-256, P-384 or P-521 key, the ones "
                              "model_signing signs with")
    for i, pem in enumerate(cas):
        try:
            x509.load_pem_x509_certificates(pem.encode())
        except ValueError as exc:
            raise ConfigError(f"{source}: CA certificate {i + 1} is not PEM ({exc})") from None
    if identities and not cas:
        raise ConfigError(f"{source}: certificate identities need the CA certificates they are issued under")
    if not keys and not cas and not allow_unsigned:
        raise ConfigError(f"{source}: a signature requirement names no public key and no CA certificate")
    return SignaturePolicy(keys, cas, identities, allow_unsigned, source)


_CURVES = frozenset({"secp256r1", "secp384r1", "secp521r1"})


def verify(policies: Sequence[SignaturePolicy], files: Mapping[str, str], *,
           read_bundle: Callable[[], bytes | None], selected: Callable[[str], bool] = lambda _: True,
           ) -> SignatureRecord | None:
    """Check the model whose files hash as `files` (path -> sha256 hex, model.sig included) against every policy;
    the record of what verified it, None when no policy asks. `read_bundle()`: model.sig's bytes (called only when
    it is listed). `selected(path)`: the reference's globs; a signed file they leave out may be missing.
    Raises SignatureError saying what failed and what to do."""
    if not policies:
        return None
    if bad := next((p for p in policies if p.invalid), None):
        raise SignatureError(f"the signature requirement of {bad.source} is invalid ({bad.invalid}); nothing it "
                             "covers is published until it is fixed")
    bundle_sha = files.get(SIGNATURE_FILE)
    if bundle_sha is None:
        if all(p.allow_unsigned for p in policies):
            return SignatureRecord("unsigned", "", "", 0)
        if not selected(SIGNATURE_FILE):
            raise SignatureError(f"the reference's include/exclude globs leave out {SIGNATURE_FILE}, and "
                                 f"{policies[0].source} requires a signature: add --include {SIGNATURE_FILE} "
                                 f"(or include: [{SIGNATURE_FILE}]) so it is fetched with the files it signs")
        raise SignatureError(f"the model has no {SIGNATURE_FILE} and {policies[0].source} requires a signature "
                             f"by {policies[0].describe()}; sign it (model_signing sign key DIR --private_key KEY "
                             f"--signature DIR/{SIGNATURE_FILE}) and upload {SIGNATURE_FILE} with it, or allow "
                             "unsigned models (docs/signing.md)")
    data = read_bundle()
    if data is None:
        raise SignatureError(f"{SIGNATURE_FILE} is over {MAX_BUNDLE_BYTES} bytes or unreadable")
    record: SignatureRecord | None = None
    for policy in policies:
        signed, record = _verify_bundle(policy, data, bundle_sha)
        _compare(signed, files, selected, policy)
    return record


def _verify_bundle(policy: SignaturePolicy, data: bytes, bundle_sha: str) -> tuple[_Signed, SignatureRecord]:
    """The signed manifest (path -> sha256) of the bundle in `data`, once its signature verifies under `policy`."""
    from model_signing._signing import sign_certificate, sign_ec_key, sign_sigstore_pb

    try:
        signature: Any = sign_sigstore_pb.Signature.read(_Loaded(data))  # type: ignore[arg-type]
        material = signature.bundle.verification_material
    except Exception as exc:  # the library parses with pydantic/json: any error is a malformed bundle
        raise SignatureError(f"{SIGNATURE_FILE} is not a model_signing bundle ({_short(exc)})") from None
    failures: list[str] = []
    if policy.recorded:
        method, signer, recorded = policy.recorded
        if bundle_sha != recorded:
            raise SignatureError(f"{SIGNATURE_FILE} (sha256 {bundle_sha[:12]}) is not the one {policy.source} "
                                 f"names ({recorded[:12] or 'none: it was published unsigned'}); fetch it again "
                                 "with --signed-by to verify the new signature")
        manifest = _recorded_verifier().verify(signature)
        return _signed_files(manifest), SignatureRecord(method, signer, bundle_sha, _count(manifest))
    if material.public_key is not None and policy.keys:
        hint = material.public_key.hint or ""
        for pem in policy.keys:
            fingerprint = key_fingerprint(pem)
            if hint and hint != fingerprint:
                continue  # the bundle names another key: not this one (rotation keeps several)
            try:
                manifest = sign_ec_key.Verifier(_Loaded(pem.encode())).verify(signature)  # type: ignore[arg-type]
            except Exception as exc:
                failures.append(f"key {fingerprint[:12]}: {_short(exc)}")
                continue
            return _signed_files(manifest), SignatureRecord("key", fingerprint, bundle_sha, _count(manifest))
        if not failures:
            failures.append(f"it was signed by key {hint[:12]}..., which is not among the "
                            f"{len(policy.keys)} key(s) accepted")
    elif material.x509_certificate_chain is not None and policy.ca_certificates:
        try:
            verifier = sign_certificate.Verifier([_Loaded("".join(policy.ca_certificates).encode())])  # type: ignore[list-item]
            manifest = verifier.verify(signature)
            identity = _identity(material, policy)
            return _signed_files(manifest), SignatureRecord("certificate", identity, bundle_sha, _count(manifest))
        except SignatureError:
            raise
        except Exception as exc:
            failures.append(f"certificate: {_short(exc)}")
    else:
        kind = "a public key" if material.public_key is not None else \
            "a certificate chain" if material.x509_certificate_chain is not None else \
            "a keyless Sigstore certificate (Fulcio/Rekor: needs the public-good trust root online)"
        failures.append(f"it is signed with {kind}, and {policy.source} accepts only {policy.describe()}")
    raise SignatureError(f"{SIGNATURE_FILE} does not verify: {'; '.join(failures)}; {policy.source} accepts "
                         f"{policy.describe()}")


def _recorded_verifier() -> Any:
    """A model_signing verifier that reads the envelope's statement without its signature: only for a bundle
    pinned by sha256 to one that verified before (recorded_policy), whose signature therefore still holds."""
    from model_signing._signing import sign_sigstore_pb

    class Recorded(sign_sigstore_pb.Verifier):
        def _verify_bundle(self, bundle: Any) -> tuple[str, bytes]:
            return bundle.dsse_envelope.payload_type, bundle.dsse_envelope.payload

    return Recorded()


def _count(manifest: Any) -> int:
    return sum(1 for _ in manifest.resource_descriptors())


@dataclass(frozen=True)
class _Signed:
    files: dict[str, str]  # path -> sha256 hex
    ignored: tuple[str, ...]  # paths the signer left out (its ignore_paths)


def _signed_files(manifest: Any) -> _Signed:
    serialization = manifest.serialization_type
    method, hash_type = serialization.get("method"), serialization.get("hash_type")
    if method != "files" or hash_type != "sha256":
        raise SignatureError(f"{SIGNATURE_FILE} signs {method!r} digests with {hash_type!r}; weightcache checks "
                             "per-file sha256 manifests against the digests it computed while fetching: sign with "
                             "model_signing's defaults (files, sha256)")
    signed = {str(rd.identifier): rd.digest.digest_hex for rd in manifest.resource_descriptors()}
    return _Signed(signed, tuple(str(p) for p in serialization.get("ignore_paths", ())))


def _compare(signed: _Signed, files: Mapping[str, str], selected: Callable[[str], bool],
             policy: SignaturePolicy) -> None:
    """The fetched files are exactly the signed ones (less what the signer ignores, and what the reference's globs
    leave out), with the signed digests."""
    ignored = (*signed.ignored, SIGNATURE_FILE, *GIT_PATHS)
    fetched = {p: d for p, d in files.items() if not _ignored(p, ignored)}
    want = signed.files
    diffs = [f"{p} is not signed" for p in sorted(set(fetched) - set(want))]
    diffs += [f"{p} is signed but missing" for p in sorted(set(want) - set(fetched)) if selected(p)]
    diffs += [f"{p} has sha256 {fetched[p][:12]}..., the signature says {want[p][:12]}..."
              for p in sorted(set(fetched) & set(want)) if fetched[p] != want[p]]
    if diffs:
        more = f" (and {len(diffs) - _DIFFS_SHOWN} more)" if len(diffs) > _DIFFS_SHOWN else ""
        raise SignatureError(f"the model's files do not match {SIGNATURE_FILE}, which verifies under "
                             f"{policy.source}: {'; '.join(diffs[:_DIFFS_SHOWN])}{more}; the model was changed "
                             "after it was signed: fetch a signed revision, or sign it again")


def _ignored(path: str, ignored: Iterable[str]) -> bool:
    return any(path == p.rstrip("/") or path.startswith(p.rstrip("/") + "/") for p in ignored)


def _identity(material: Any, policy: SignaturePolicy) -> str:
    """The signing certificate's identity (its SAN emails, URIs, DNS names; else its subject), checked against the
    policy's identities when it names some."""
    from cryptography import x509

    cert = x509.load_der_x509_certificate(material.x509_certificate_chain.certificates[0].raw_bytes)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = [*san.get_values_for_type(x509.RFC822Name), *san.get_values_for_type(x509.UniformResourceIdentifier),
                 *san.get_values_for_type(x509.DNSName)]
    except x509.ExtensionNotFound:
        names = []
    names = names or [cert.subject.rfc4514_string()]
    if policy.identities and not set(names) & set(policy.identities):
        raise SignatureError(f"{SIGNATURE_FILE} is signed by a certificate for {', '.join(names)}, which chains to "
                             f"a CA {policy.source} accepts but is not one of its identities "
                             f"({', '.join(policy.identities)})")
    return names[0]


class _Loaded:
    """Bytes already read (bounded, no symlink followed) handed to model_signing, whose readers take a path and
    call only `read_text`/`read_bytes` on it."""

    def __init__(self, data: bytes) -> None:
        self._data = data

    def read_bytes(self) -> bytes:
        return self._data

    def read_text(self, encoding: str = "utf-8") -> str:
        return self._data.decode(encoding)


def _short(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."


__all__ = ["MAX_BUNDLE_BYTES", "SIGNATURE_FILE", "SignaturePolicy", "SignatureRecord", "key_fingerprint",
           "make_policy", "parse_policy", "policy_from_spec", "verify"]
