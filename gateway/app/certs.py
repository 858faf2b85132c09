"""A test CA and the certificates of a TLS setup: ``lightgate tls-certs``, for trying TLS and mTLS without a PKI.

Writes into one directory::

    ca.pem, ca.key            the CA (reused when the directory already has both: issue more clients later)
    server.pem, server.key    the node's certificate for every --host (DNS names and IP addresses)
    <client>.pem, .key        one per --client: CN = the name (auth.use_identity_as_username takes it)

Keys are ECDSA P-256, unencrypted PKCS#8 PEM, mode 0600 (``tls.keyfile`` is
read unencrypted); certificates carry the extensions strict verifiers ask for
(subject alternative names, key usages, key identifiers). Existing files other
than the CA are never overwritten. A test CA is not a PKI: there is no
revocation, and its key signs whatever the directory's owner asks.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

__all__ = ["Issued", "issue"]

CA_DAYS = 3650
"""The test CA outlives the certificates it signs, so clients issued later chain to the same one."""

BACKDATE = datetime.timedelta(minutes=5)
"""Certificates start this far in the past: a peer whose clock is a little behind still accepts them."""


@dataclass(frozen=True, slots=True)
class Issued:
    """What :func:`issue` wrote: every file, and whether the CA was made now or reused."""

    files: list[Path]
    new_ca: bool


def _san(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "LightGate test"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(path: Path, data: bytes, mode: int) -> None:
    """Create ``path`` with ``mode`` (never replacing a file: O_EXCL) and write ``data``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "wb") as out:
        out.write(data)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _load_or_make_ca(out: Path, now: datetime.datetime) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey, bool]:
    cert_path, key_path = out / "ca.pem", out / "ca.key"
    if cert_path.exists() and key_path.exists():
        cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
        key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != cert.public_key():
            raise ValueError(f"{key_path} is not the key of {cert_path}")
        return cert, key, False
    if cert_path.exists() or key_path.exists():
        raise ValueError(f"{out} has only one of ca.pem and ca.key: remove it, or bring the other")
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"LightGate test CA {now:%Y-%m-%d %H:%M:%S}")
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - BACKDATE).not_valid_after(now + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=False, content_commitment=False, key_encipherment=False,
                                         data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                         crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256()))
    return cert, key, True


def _leaf(ca: x509.Certificate, ca_key: ec.EllipticCurvePrivateKey, common_name: str, names: list[str],
          usage: x509.ObjectIdentifier, now: datetime.datetime,
          days: int) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    builder = (x509.CertificateBuilder().subject_name(_name(common_name)).issuer_name(ca.subject)
               .public_key(key.public_key()).serial_number(x509.random_serial_number())
               .not_valid_before(now - BACKDATE).not_valid_after(now + datetime.timedelta(days=days))
               .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False,
                                            key_encipherment=False, data_encipherment=False, key_agreement=False,
                                            key_cert_sign=False, crl_sign=False, encipher_only=False,
                                            decipher_only=False), critical=True)
               .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
               .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
               .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                              critical=False))
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName([_san(n) for n in names]), critical=False)
    return builder.sign(ca_key, hashes.SHA256()), key


def issue(out: Path, hosts: list[str], clients: list[str], *, days: int = 365) -> Issued:
    """Write the CA (unless ``out`` has one), a server certificate for ``hosts`` and a certificate per client.

    Args:
        out: the directory (created if missing).
        hosts: DNS names and IP addresses the node is reached by; the first is the server's CN. Empty: no
            server certificate (only clients, from an existing CA).
        clients: client names (each the CN of its certificate, and its files' name).
        days: the validity of the server and client certificates.

    Raises:
        ValueError: a name that cannot be a file name, ``days`` < 1, a half CA, or a file that already exists
            (nothing is written then).
        OSError: the directory cannot be written.
    """
    if not hosts and not clients:
        raise ValueError("nothing to issue: give --host NAME (a server certificate) and/or --client NAME")
    if days < 1:
        raise ValueError(f"--days must be at least 1, not {days}")
    for name in clients:
        if not name or name in ("ca", "server") or "/" in name or name.startswith(".") or "\0" in name:
            raise ValueError(f"client name {name!r} cannot name its files (not empty, ca, server, '/', '.' first)")
    out.mkdir(parents=True, exist_ok=True)
    leaves = (["server"] if hosts else []) + clients
    taken = [p for name in leaves for p in (out / f"{name}.pem", out / f"{name}.key") if p.exists()]
    if taken:
        raise ValueError(f"{', '.join(map(str, taken))} already exist: remove them or use another --out")
    now = datetime.datetime.now(datetime.timezone.utc)
    ca, ca_key, new_ca = _load_or_make_ca(out, now)
    written: list[Path] = []
    if new_ca:
        _write(out / "ca.key", _key_pem(ca_key), 0o600)
        _write(out / "ca.pem", ca.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [out / "ca.pem", out / "ca.key"]
    for name in leaves:
        server = name == "server" and bool(hosts)
        cert, key = _leaf(ca, ca_key, hosts[0] if server else name, hosts if server else [],
                          ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH, now, days)
        _write(out / f"{name}.key", _key_pem(key), 0o600)
        _write(out / f"{name}.pem", cert.public_bytes(serialization.Encoding.PEM), 0o644)
        written += [out / f"{name}.pem", out / f"{name}.key"]
    return Issued(written, new_ca)
