"""``llmbatch api`` (or ``python -m llmbatch.api``): serve the OpenAI-compatible API with uvicorn
(127.0.0.1:8080 by default).

Settings come from the environment (:mod:`llmbatch.api.settings`); ``--host`` / ``--port`` override
``LLMBATCH_API__HOST`` / ``LLMBATCH_API__PORT``. ``llmbatch api --hash-key`` reads an API key from
stdin and prints the SHA-256 hash to put into ``LLMBATCH_API__KEYS``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from fastapi import FastAPI

from llmbatch.api.settings import ApiSettings


def build_app(settings: ApiSettings) -> FastAPI:
    """The app wired to the real Kafka, Redis and MinIO of ``settings`` (connections open lazily)."""
    from llmbatch.adapters.kafka import Publisher
    from llmbatch.api.http.app import build_services, create_app
    from llmbatch.api.store.state import RedisStateReader
    from llmbatch.api.store.storage import MinioObjectStore
    from llmbatch.api.tenancy.usage import RedisUsage
    from llmbatch.dispatcher.state.retention import RetentionIndex
    from llmbatch.dispatcher.state.store import StateStore
    from llmbatch.dispatcher.webhooks.store import WebhookStore
    from llmbatch.schemas.tenant_auth import TenantSigner

    options = settings.api
    store = StateStore.from_settings(settings.redis, socket_timeout=options.connect_timeout_s)
    publisher = Publisher(
        settings.kafka,
        connect_timeout_s=options.connect_timeout_s,
        publish_timeout_s=options.publish_timeout_s,
        signer=TenantSigner(settings.tenants.key_bytes()),
    )
    services = build_services(
        options,
        objects=MinioObjectStore(settings.s3, timeout_s=options.connect_timeout_s),
        state=RedisStateReader(store),
        publisher=publisher,
        input_bucket=settings.s3.input_bucket,
        results_bucket=settings.s3.results_bucket,
        requests_topic=settings.kafka.topics.requests,
        webhook_settings=settings.webhooks,
        endpoints=WebhookStore(store.client, store.keys) if settings.webhooks.enabled else None,
        usage=RedisUsage(store.client, store.keys),
        token_limits=settings.tenants.max_enqueued_tokens,
        storage_limits=settings.tenants.max_stored_bytes,
        retention=settings.retention,
        retention_index=RetentionIndex(store.client, store.keys),
    )
    return create_app(services, on_close=[publisher.stop, store.close])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmbatch api",
        description="llmbatch's OpenAI-compatible HTTP API (Files and Batches). Settings: LLMBATCH_* "
        "environment variables (LLMBATCH_API__KEYS maps SHA-256 hashes of API keys to tenants).",
    )
    p.add_argument("--host", help="address to bind (default LLMBATCH_API__HOST, 127.0.0.1)")
    p.add_argument("--port", type=int, help="port (default LLMBATCH_API__PORT, 8080)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--hash-key",
        action="store_true",
        help="read an API key from stdin, print its SHA-256 hash (for LLMBATCH_API__KEYS), exit",
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.hash_key:
        from llmbatch.api.tenancy.auth import hash_api_key

        key = sys.stdin.readline().strip()
        if not key:
            print("error: no key on stdin", file=sys.stderr)
            return 2
        print(hash_api_key(key))
        return 0
    try:
        settings = ApiSettings()
    except ValueError as exc:  # pydantic's ValidationError is a ValueError
        print(f"error: invalid settings: {' '.join(str(exc).split())}", file=sys.stderr)
        return 1
    if not settings.api.keys:
        print("warning: LLMBATCH_API__KEYS is empty: every call will be refused (401)", file=sys.stderr)
    import uvicorn

    uvicorn.run(
        build_app(settings),
        host=args.host or settings.api.host,
        port=args.port if args.port is not None else settings.api.port,
        log_level=args.log_level,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
