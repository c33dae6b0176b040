"""Certificates for the TLS tests: a CA, a server certificate for 127.0.0.1, client certificates."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write(directory: Path, name: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> tuple[str, str]:
    cert_path, key_path = directory / f"{name}.pem", directory / f"{name}-key.pem"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return str(cert_path), str(key_path)


def _issue(subject: str, issuer: x509.Name, signer, key, *, ca: bool = False, server: bool = False):
    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if server:
        names = [x509.IPAddress(ipaddress.ip_address("127.0.0.1")), x509.DNSName("localhost")]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(signer, hashes.SHA256())


@dataclass(frozen=True)
class Certs:
    ca: str
    server: tuple[str, str]
    client: tuple[str, str]
    stranger: tuple[str, str]  # a client certificate from another CA


def make_certs(directory: Path) -> Certs:
    ca_key = _key()
    ca_cert = _issue("gym-grpc test CA", _name("gym-grpc test CA"), ca_key, ca_key, ca=True)
    ca_path, _ = _write(directory, "ca", ca_cert, ca_key)
    server_key, client_key = _key(), _key()
    server = _write(directory, "server", _issue("server", ca_cert.subject, ca_key, server_key, server=True), server_key)
    client = _write(directory, "client", _issue("client", ca_cert.subject, ca_key, client_key), client_key)
    other_key = _key()
    other_ca = _issue("other CA", _name("other CA"), other_key, other_key, ca=True)
    stranger_key = _key()
    stranger = _write(
        directory, "stranger", _issue("stranger", other_ca.subject, other_key, stranger_key), stranger_key
    )
    return Certs(ca_path, server, client, stranger)
