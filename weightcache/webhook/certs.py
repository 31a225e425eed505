"""Serving certificates for the webhook where cert-manager is absent.

The API server calls the webhook at `https://<service>.<namespace>.svc:443/mutate` and trusts only the
`caBundle` of the MutatingWebhookConfiguration, so we make a small CA and a serving certificate for the
service's DNS names (ECDSA P-256: fast handshakes, small bundle). `write_service_certs` writes

    <out>/ca.crt      the CA certificate: its base64 is the caBundle
    <out>/tls.crt     serving certificate (leaf, then CA) for <svc>, <svc>.<ns>, <svc>.<ns>.svc, ....cluster.local
    <out>/tls.key     its private key, mode 0600

The CA key is never written: renewing means running the command again and patching the new caBundle
(cert-manager does that on its own; see deploy/cert-manager/).
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


@dataclass(frozen=True)
class CertPair:
    """A PEM certificate (chain) and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes = b""


def service_dns_names(service: str, namespace: str) -> list[str]:
    return [service, f"{service}.{namespace}", f"{service}.{namespace}.svc", f"{service}.{namespace}.svc.cluster.local"]


def make_ca(common_name: str = "weightcache-webhook-ca", *, days: int = 3650) -> CertPair:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    builder = (
        _base(name, name, key.public_key(), days)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(False, False, False, False, False, True, True, False, False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return CertPair(_pem(builder.sign(key, hashes.SHA256())), _key_pem(key))


def make_serving_cert(
    ca: CertPair,
    dns_names: Sequence[str],
    *,
    ip_addresses: Sequence[str] = (),
    days: int = 365,
) -> CertPair:
    """A server certificate signed by `ca`; `cert_pem` holds the leaf followed by the CA certificate."""
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    ca_key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey):
        raise TypeError("the CA key must be an EC key made by make_ca")
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, (list(dns_names) or list(ip_addresses))[0])])
    san = [x509.DNSName(n) for n in dns_names] + [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
    builder = (
        _base(subject, ca_cert.subject, key.public_key(), days)
        .add_extension(x509.SubjectAlternativeName(san), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, False, False, False, False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
    )
    return CertPair(_pem(builder.sign(ca_key, hashes.SHA256())) + ca.cert_pem, _key_pem(key))


def write_service_certs(out: Path, *, service: str, namespace: str) -> str:
    """Write ca.crt, tls.crt and tls.key for the service into `out`; return the caBundle (base64 of ca.crt)."""
    ca = make_ca()
    serving = make_serving_cert(ca, service_dns_names(service, namespace))
    out.mkdir(parents=True, exist_ok=True)
    _write(out / "ca.crt", ca.cert_pem, 0o644)
    _write(out / "tls.crt", serving.cert_pem, 0o644)
    _write(out / "tls.key", serving.key_pem, 0o600)
    return base64.b64encode(ca.cert_pem).decode()


def _base(
    subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey, days: int
) -> x509.CertificateBuilder:
    now = dt.datetime.now(dt.UTC)
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(public_key)
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))  # tolerate clock skew between nodes
        .not_valid_after(now + dt.timedelta(days=days))
    )


def _pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _write(path: Path, data: bytes, mode: int) -> None:
    """Write via a temporary file created with the final mode, then rename: a key is never readable by others."""
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, mode)
    os.replace(tmp, path)
