"""A certificate authority made on the spot, for a local stack whose every hop is TLS.

:func:`make_local_ca` writes a CA and one server certificate for ``127.0.0.1`` / ``localhost``
(what the local Kafka, Redis and MinIO present) into a folder, keys readable by their owner only. The
local Ray head presents it too (its gRPC: GCS, raylets, workers, with ``RAY_USE_TLS``); Ray's processes
call each other at the node's own address, which ``node_ips`` adds to the certificate.
Clients verify the servers against ``ca.pem`` (``LLMBATCH_KAFKA__SSL_CAFILE``,
``LLMBATCH_REDIS__SSL_CA_CERTS``, ``LLMBATCH_S3__CA_FILE``). Nothing here is for production: there
the certificates come from the cluster's own CA (cert-manager, a cloud's), and these settings point
at its bundle.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.ec import EllipticCurvePrivateKey
    from cryptography.x509 import Certificate

VALID_FOR = dt.timedelta(days=7)


@dataclass(frozen=True)
class TlsFiles:
    """PEM files of a local CA and the server certificate it signed."""

    ca_cert: Path
    """The CA's certificate: what clients trust."""
    server_cert: Path
    """The server's certificate (for 127.0.0.1 and localhost)."""
    server_key: Path
    """The server's private key (PKCS#8, unencrypted; mode 0600)."""

    @property
    def server_keystore(self) -> Path:
        """Key and certificate in one PEM file (a Kafka ``ssl.keystore.type=PEM`` keystore)."""
        return self.server_key.with_name("server-keystore.pem")


def write_private(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file at ``path`` readable by its owner only (mode 0600)."""
    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)


def key_pem(key: EllipticCurvePrivateKey) -> bytes:
    """``key`` as unencrypted PKCS#8 PEM."""
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def new_ca(
    common_name: str, now: dt.datetime, valid_for: dt.timedelta = VALID_FOR
) -> tuple[EllipticCurvePrivateKey, Certificate]:
    """A new self-signed CA (P-256) named ``common_name``, valid from five minutes before ``now``
    for ``valid_for``, that signs certificates only (no CA below it)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(ca_name)
        .issuer_name(ca_name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + valid_for)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return ca_key, ca_cert


def local_ca(folder: Path, *, node_ips: tuple[str, ...] = ()) -> TlsFiles:
    """The CA in ``folder`` if it is complete, valid for at least another day and its server
    certificate names every address of ``node_ips``, else a new one."""
    from cryptography import x509

    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    paths = (files.ca_cert, files.server_cert, files.server_key, files.server_keystore)
    if all(p.exists() for p in paths):
        cert = x509.load_pem_x509_certificate(files.server_cert.read_bytes())
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        named = {str(ip) for ip in names.get_values_for_type(x509.IPAddress)}
        fresh = cert.not_valid_after_utc - dt.datetime.now(dt.UTC) > dt.timedelta(days=1)
        if fresh and set(node_ips) <= named:
            return files
    return make_local_ca(folder, node_ips=node_ips)


def make_local_ca(
    folder: Path, *, now: dt.datetime | None = None, node_ips: tuple[str, ...] = ()
) -> TlsFiles:
    """Write a fresh CA and a server certificate for 127.0.0.1/localhost (and ``node_ips``, this
    machine's own addresses) into ``folder``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    folder.mkdir(parents=True, exist_ok=True)
    now = now or dt.datetime.now(dt.UTC)
    ca_key, ca_cert = new_ca("llmbatch local test CA", now)
    ca_name = ca_cert.subject
    key = ec.generate_private_key(ec.SECP256R1())
    server_cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(
            x509.SubjectAlternativeName(
                [
                    x509.DNSName("localhost"),
                    *(
                        x509.IPAddress(ipaddress.ip_address(ip))
                        for ip in dict.fromkeys(("127.0.0.1", *node_ips))
                    ),
                ]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
            critical=False,
        )
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False
        )
        .sign(ca_key, hashes.SHA256())
    )
    files = TlsFiles(folder / "ca.pem", folder / "server.pem", folder / "server.key")
    files.ca_cert.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert_pem = server_cert.public_bytes(serialization.Encoding.PEM)
    files.server_cert.write_bytes(cert_pem)
    server_key_pem = key_pem(key)
    write_private(files.server_key, server_key_pem)
    write_private(files.server_keystore, server_key_pem + cert_pem)
    return files
