"""What every HTTP call to Ray needs (the dashboard's Jobs and Serve APIs, Serve's HTTP proxy): the TLS
context of an https:// address, verified with the settings' CA bundle, and the cluster's bearer token."""

from __future__ import annotations

import ssl
from pathlib import Path

from pydantic import SecretStr


def tls_context(url: str, ca_file: Path | None) -> ssl.SSLContext | None:
    """The context that verifies ``url``'s server (``ca_file``, else the system's CAs); ``None`` for
    http://, where urllib wants none."""
    if not url.startswith("https://"):
        return None
    return ssl.create_default_context(cafile=str(ca_file) if ca_file is not None else None)


def auth_headers(token: SecretStr | None) -> dict[str, str]:
    """``Authorization`` for a cluster with Ray's token auth on; nothing without a token."""
    return {"Authorization": f"Bearer {token.get_secret_value()}"} if token is not None else {}
