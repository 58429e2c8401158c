"""Who the test control plane's own components are: client certificates signed by a CA the API
server trusts (``--client-ca-file``), as kubeadm gives them. The certificate's common name is the
user, its organizations the groups; so a node's kubelet is ``system:node:<name>`` in
``system:nodes`` (the Node authorizer and the NodeRestriction admission plugin then limit it to its
own Node and what its pods use), kube-proxy is ``system:kube-proxy`` (bound to
``system:node-proxier`` by the API server's own RBAC policy), and CoreDNS a user given only the
reads it needs. Nothing here is for production.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from llmbatch.stack.tls import key_pem, new_ca, write_private

VALID_FOR = dt.timedelta(days=2)


@dataclass(frozen=True)
class ClientCa:
    """The CA's certificate (the API server's ``--client-ca-file``) and its key."""

    cert: Path
    key: Path


@dataclass(frozen=True)
class ClientCert:
    """A client certificate and its key (mode 0600), PEM."""

    cert: Path
    key: Path


def make_client_ca(folder: Path) -> ClientCa:
    """Write a new client CA into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    key, cert = new_ca("llmbatch test client CA", dt.datetime.now(dt.UTC), VALID_FOR)
    ca = ClientCa(folder / "client-ca.pem", folder / "client-ca.key")
    ca.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(ca.key, key_pem(key))
    return ca


def issue_client_cert(ca: ClientCa, folder: Path, user: str, groups: Sequence[str] = ()) -> ClientCert:
    """A certificate for ``user`` in ``groups``, signed by ``ca``, written into ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    now = dt.datetime.now(dt.UTC)
    ca_cert = x509.load_pem_x509_certificate(ca.cert.read_bytes())
    ca_key = serialization.load_pem_private_key(ca.key.read_bytes(), password=None)
    assert isinstance(ca_key, ec.EllipticCurvePrivateKey)
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name(
        [
            *(x509.NameAttribute(NameOID.ORGANIZATION_NAME, g) for g in groups),
            x509.NameAttribute(NameOID.COMMON_NAME, user),
        ]
    )
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + VALID_FOR)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    stem = user.replace(":", "-")
    issued = ClientCert(folder / f"{stem}.pem", folder / f"{stem}.key")
    issued.cert.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    write_private(issued.key, key_pem(key))
    return issued


def write_cert_kubeconfig(path: Path, server: str, ca_cert: Path, client: ClientCert) -> None:
    """A kubeconfig (mode 0600) for ``server`` authenticating with ``client``'s certificate."""
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "current-context": "local",
        "clusters": [{"name": "local", "cluster": {"server": server, "certificate-authority": str(ca_cert)}}],
        "users": [
            {
                "name": "component",
                "user": {"client-certificate": str(client.cert), "client-key": str(client.key)},
            }
        ],
        "contexts": [{"name": "local", "context": {"cluster": "local", "user": "component"}}],
    }
    path.write_text(json.dumps(config))
    path.chmod(0o600)
