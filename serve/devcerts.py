"""Throwaway TLS material for tests and the local demo: a CA, a server and a client certificate.

Never for production: the CA key sits next to the certificates (ca.key, so a test can issue more
client certificates), lifetimes are short, and nothing is revoked. Production certificates come
from the operator's own CA (cert-manager, Vault, ...).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

from scorestack.serve.security import CA_FILE, CLIENT_CERT_FILE, CLIENT_KEY_FILE, SERVER_CERT_FILE, SERVER_KEY_FILE

DEFAULT_HOSTS = ("127.0.0.1", "localhost")
CA_KEY_FILE = "ca.key"


@dataclass(frozen=True)
class DevCerts:
    """Paths of the files written by `write_dev_certs` (PEM)."""

    directory: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _key():
    from cryptography.hazmat.primitives.asymmetric import ec

    # P-256: fast to generate and to handshake, accepted by gRPC's BoringSSL and by OpenSSL.
    return ec.generate_private_key(ec.SECP256R1())


def _write_key(path: Path, key) -> None:
    from cryptography.hazmat.primitives import serialization

    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(pem)


def _write_cert(path: Path, cert) -> None:
    from cryptography.hazmat.primitives import serialization

    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def _name(common_name: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "scorestack dev (throwaway)"), x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _sans(hosts: tuple[str, ...]):
    from cryptography import x509

    names = []
    for h in hosts:
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(h)))
        except ValueError:
            names.append(x509.DNSName(h))
    return x509.SubjectAlternativeName(names)


def _issue(subject: str, key, ca_name, ca_key, *, not_before: dt.datetime, not_after: dt.datetime, server: bool, hosts: tuple[str, ...]):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.x509.oid import ExtendedKeyUsageOID

    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(not_before)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH if server else ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
    )
    if server:
        builder = builder.add_extension(_sans(hosts), critical=False)
    return builder.sign(ca_key, hashes.SHA256())


def write_dev_certs(
    directory: str | os.PathLike[str],
    *,
    hosts: tuple[str, ...] = DEFAULT_HOSTS,
    days: int = 7,
    expired: bool = False,
    ca_name: str | None = None,
) -> DevCerts:
    """Create a CA and a server certificate (for `hosts`) and a client certificate signed by it in `directory`.

    `expired=True` writes a server and client certificate whose validity ended yesterday (for the
    tests that check an expired certificate is refused, and says so).
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.timezone.utc)
    ca_key = _key()
    # A distinct name per CA: two throwaway CAs must not look like one to a verifier.
    name = _name(ca_name or f"scorestack throwaway dev CA {x509.random_serial_number() % 10**8:08d}")
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=2))
        .not_valid_after(now + dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    if expired:
        start, end = now - dt.timedelta(days=2), now - dt.timedelta(days=1)
    else:
        start, end = now - dt.timedelta(minutes=5), now + dt.timedelta(days=days)
    server_key, client_key = _key(), _key()
    server = _issue(hosts[0], server_key, name, ca_key, not_before=start, not_after=end, server=True, hosts=hosts)
    client = _issue("scorestack client", client_key, name, ca_key, not_before=start, not_after=end, server=False, hosts=hosts)
    files = DevCerts(d, d / CA_FILE, d / SERVER_CERT_FILE, d / SERVER_KEY_FILE, d / CLIENT_CERT_FILE, d / CLIENT_KEY_FILE)
    _write_cert(files.ca, ca)
    _write_cert(files.server_cert, server)
    _write_key(files.server_key, server_key)
    _write_cert(files.client_cert, client)
    _write_key(files.client_key, client_key)
    _write_key(d / CA_KEY_FILE, ca_key)
    return files


def issue_client_cert(directory: str | os.PathLike[str], name: str, *, expired: bool = False, days: int = 7) -> tuple[Path, Path]:
    """Sign one more client certificate with the throwaway CA in `directory`: (cert, key) as `<name>.crt`, `<name>.key`."""
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    d = Path(directory)
    ca = x509.load_pem_x509_certificate((d / CA_FILE).read_bytes())
    ca_key = serialization.load_pem_private_key((d / CA_KEY_FILE).read_bytes(), password=None)
    now = dt.datetime.now(dt.timezone.utc)
    start, end = (now - dt.timedelta(days=2), now - dt.timedelta(days=1)) if expired else (now - dt.timedelta(minutes=5), now + dt.timedelta(days=days))
    key = _key()
    cert = _issue(name, key, ca.subject, ca_key, not_before=start, not_after=end, server=False, hosts=())
    cert_path, key_path = d / f"{name}.crt", d / f"{name}.key"
    _write_cert(cert_path, cert)
    _write_key(key_path, key)
    return cert_path, key_path
