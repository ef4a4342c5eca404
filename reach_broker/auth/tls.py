"""A local certificate authority and a server certificate for 127.0.0.1/localhost.

Made with the ``cryptography`` package (the optional extra ``nats-reach[tls]``): the standard,
well-kept X.509 library for Python, portable where an ``openssl`` binary may be missing or
differ in flags. ECDSA P-256 keys; the certificates carry the extensions strict verifiers
(Python 3.13's default ``VERIFY_X509_STRICT``, Go's crypto/tls) insist on.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
from pathlib import Path
from typing import Any

from .claims import AuthError
from .files import write_private, write_public

CA_DAYS = 3650
SERVER_DAYS = 825
SERVER_NAMES = ("localhost",)
SERVER_IPS = ("127.0.0.1", "::1")


def _crypto() -> Any:
    try:
        import cryptography  # noqa: F401
    except ImportError:
        raise AuthError(
            "TLS certificates need the 'cryptography' package: pip install 'nats-reach[tls]'"
        ) from None
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    return x509, hashes, serialization, ec, ExtendedKeyUsageOID, NameOID


def require() -> None:
    """Fail at once, with the install hint, when certificates cannot be made here."""
    _crypto()


def make(
    ca_cert: Path, ca_key: Path, server_cert: Path, server_key: Path, *, org: str = "reach"
) -> None:
    """Write a new CA and a server certificate it signs (PEM; keys unencrypted, mode 0600)."""
    x509, hashes, serialization, ec, eku, name_oid = _crypto()
    now = dt.datetime.now(dt.UTC)

    def name(common: str) -> Any:
        return x509.Name(
            [
                x509.NameAttribute(name_oid.ORGANIZATION_NAME, org),
                x509.NameAttribute(name_oid.COMMON_NAME, common),
            ]
        )

    def key_usage(*, signs_certificates: bool) -> Any:
        sign = signs_certificates
        return x509.KeyUsage(
            digital_signature=True,
            key_cert_sign=sign,
            crl_sign=sign,
            content_commitment=False,
            key_encipherment=False,
            data_encipherment=False,
            key_agreement=False,
            encipher_only=False,
            decipher_only=False,
        )

    ca_priv = ec.generate_private_key(ec.SECP256R1())
    ca_name = name(f"{org} local CA")
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_priv.public_key())
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_priv.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=CA_DAYS))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(key_usage(signs_certificates=True), critical=True)
        .add_extension(ca_ski, critical=False)
        .sign(ca_priv, hashes.SHA256())
    )
    srv_priv = ec.generate_private_key(ec.SECP256R1())
    sans = [x509.DNSName(n) for n in SERVER_NAMES]
    sans += [x509.IPAddress(ipaddress.ip_address(ip)) for ip in SERVER_IPS]
    srv = (
        x509.CertificateBuilder()
        .subject_name(name("localhost"))
        .issuer_name(ca_name)
        .public_key(srv_priv.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=SERVER_DAYS))
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(key_usage(signs_certificates=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage([eku.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(
            x509.SubjectKeyIdentifier.from_public_key(srv_priv.public_key()), critical=False
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False
        )
        .sign(ca_priv, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM

    def key_bytes(k: Any) -> bytes:
        return bytes(
            k.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )

    write_private(ca_key, key_bytes(ca_priv))
    write_public(ca_cert, ca.public_bytes(pem))
    write_private(server_key, key_bytes(srv_priv))
    write_public(server_cert, srv.public_bytes(pem))
