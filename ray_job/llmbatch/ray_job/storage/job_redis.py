"""The job's Redis client, as every job process makes it: the URL it is given (no password in it), the
password from the node's environment (``LLMBATCH_REDIS__PASSWORD``), the CA of a ``rediss://`` server
from ``LLMBATCH_REDIS__SSL_CA_CERTS``. ``redis`` is imported on call (``ray_job`` imports without it)."""

from __future__ import annotations

import os
from typing import Any

from llmbatch.ray_job.storage import node_secrets


def connect(redis_url: str, *, timeout_s: float) -> Any:
    """A ``redis.Redis`` for ``redis_url`` with the node's password and CA and ``timeout_s`` for
    connecting and for each call."""
    import redis

    ca = os.environ.get("LLMBATCH_REDIS__SSL_CA_CERTS")
    return redis.Redis.from_url(
        redis_url,
        **({"ssl_ca_certs": ca} if ca and redis_url.startswith("rediss://") else {}),
        password=os.environ.get(node_secrets.REDIS_PASSWORD) or None,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )
