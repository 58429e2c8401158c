"""Connection settings shared by the producer SDK, the dispatcher and the local stack.

Everything comes from the environment (prefix ``LLMBATCH_``, ``__`` for nesting, e.g.
``LLMBATCH_KAFKA__BOOTSTRAP_SERVERS``) or a ``.env`` file. Credentials are ``SecretStr`` and are
never logged. This module imports no client library, so any package may use it.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import BaseModel, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

# re-exported: the settings' groups are imported from here
from llmbatch.settings.retention import RetentionSettings as RetentionSettings
from llmbatch.settings.tenants import TenantSettings as TenantSettings
from llmbatch.settings.webhooks import WebhookSettings as WebhookSettings

MIN_MESSAGE_BYTES = 64 << 10
"""Smallest ``max.message.bytes`` llmbatch accepts: a reduced dead letter must always fit."""
MAX_MESSAGE_BYTES = 100 << 20
"""Largest: a broker's default ``socket.request.max.bytes`` (a bigger record never reaches it)."""
DLT_HEADROOM_BYTES = 64 << 10
"""What the dead-letter topic takes beyond the requests topic by default: the ``kafka_dlt-*`` headers."""


class TopicSettings(BaseModel):
    """Topic names (DESIGN.md) and how to create them when missing."""

    requests: str = "llm.batch.requests.v1"
    results: str = "llm.batch.results.v1"
    dead_letter: str = "llm.batch.requests.v1.dlt"
    partitions: int = Field(default=3, ge=1, le=1000)
    replication_factor: int = Field(default=1, ge=1, le=10)
    max_message_bytes: int = Field(
        default=2 << 20,
        ge=MIN_MESSAGE_BYTES,
        le=MAX_MESSAGE_BYTES,
        description="max.message.bytes of the requests and results topics when llmbatch creates them "
        "(an inline batch at the inline limits must fit); producers refuse bigger records.",
    )
    dead_letter_max_message_bytes: int = Field(
        default=(2 << 20) + DLT_HEADROOM_BYTES,
        ge=MIN_MESSAGE_BYTES,
        le=MAX_MESSAGE_BYTES,
        description="max.message.bytes of the dead-letter topic when llmbatch creates it. A dead letter "
        "that would not fit is written reduced: no value, the value's size and SHA-256, and the original "
        "record's topic/partition/offset to read it from.",
    )


class KafkaSettings(BaseModel):
    """Broker address and security. Defaults suit the local stack (PLAINTEXT on loopback)."""

    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "llmbatch"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER"] | None = None
    sasl_username: str | None = None
    sasl_password: SecretStr | None = None
    ssl_cafile: Path | None = None
    ssl_certfile: Path | None = None
    ssl_keyfile: Path | None = None
    ssl_check_hostname: bool = True
    request_timeout_ms: int = Field(default=30_000, ge=1_000)
    topics: TopicSettings = TopicSettings()

    @field_validator("bootstrap_servers")
    @classmethod
    def _servers_have_ports(cls, value: str) -> str:
        hosts = [h.strip() for h in value.split(",") if h.strip()]
        if not hosts:
            raise ValueError("set LLMBATCH_KAFKA__BOOTSTRAP_SERVERS to host:port[,host:port]")
        for host in hosts:
            _, sep, port = host.rpartition(":")
            if not sep or not port.isdigit():
                raise ValueError(f"bootstrap server {host!r} needs host:port, e.g. 127.0.0.1:9092")
        return ",".join(hosts)

    @model_validator(mode="after")
    def _sasl_complete(self) -> KafkaSettings:
        if self.security_protocol.startswith("SASL") and self.sasl_mechanism is None:
            raise ValueError(
                "security_protocol SASL_* needs LLMBATCH_KAFKA__SASL_MECHANISM (PLAIN, SCRAM-SHA-256, ...)"
            )
        if self.sasl_mechanism in {"PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"} and (
            not self.sasl_username or self.sasl_password is None
        ):
            raise ValueError(
                "SASL PLAIN/SCRAM needs LLMBATCH_KAFKA__SASL_USERNAME and LLMBATCH_KAFKA__SASL_PASSWORD"
            )
        return self

    def client_kwargs(self) -> dict[str, object]:
        """Keyword arguments common to aiokafka producers, consumers and admin clients."""
        kwargs: dict[str, object] = {
            "bootstrap_servers": self.bootstrap_servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
        }
        if self.security_protocol in {"SSL", "SASL_SSL"}:
            import ssl  # local: only TLS users pay for it

            context = ssl.create_default_context(cafile=str(self.ssl_cafile) if self.ssl_cafile else None)
            if self.ssl_certfile:
                context.load_cert_chain(
                    str(self.ssl_certfile), str(self.ssl_keyfile) if self.ssl_keyfile else None
                )
            context.check_hostname = self.ssl_check_hostname
            kwargs["ssl_context"] = context
        if self.sasl_mechanism:
            kwargs["sasl_mechanism"] = self.sasl_mechanism
            kwargs["sasl_plain_username"] = self.sasl_username
            if self.sasl_password is not None:
                kwargs["sasl_plain_password"] = self.sasl_password.get_secret_value()
        return kwargs


class RedisSettings(BaseModel):
    """Redis holding batch state; the password is kept apart from the URL so it is never logged."""

    url: str = "redis://127.0.0.1:6379/0"
    password: SecretStr | None = None
    key_prefix: str = "llmbatch"
    ssl_ca_certs: Path | None = Field(
        default=None,
        description="CA bundle to verify a rediss:// server (default: the system's). The same path must "
        "hold it on the Ray nodes (jobs and the batch runner get LLMBATCH_REDIS__SSL_CA_CERTS).",
    )

    @field_validator("url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        if not value.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("LLMBATCH_REDIS__URL must start with redis://, rediss:// or unix://")
        return value

    def url_without_password(self, username: str | None = None) -> str:
        """The URL with any password written into it removed (what may go into a job spec); with
        ``username``, that user instead of the URL's (a job's own ACL user)."""
        parts = urlsplit(self.url)
        if parts.password is None and username is None:
            return self.url
        host = parts.netloc.rsplit("@", 1)[-1]
        user = username if username is not None else parts.username
        netloc = f"{user}@{host}" if user else host
        return urlunsplit(parts._replace(netloc=netloc))

    def effective_password(self) -> str | None:
        """The password to authenticate with: the setting, else one written into the URL."""
        if self.password is not None:
            return self.password.get_secret_value()
        return unquote(urlsplit(self.url).password or "") or None


class S3Settings(BaseModel):
    """MinIO/S3 endpoint and the buckets llmbatch may read from and write to."""

    endpoint: str = "http://127.0.0.1:9000"
    access_key: SecretStr = SecretStr("")
    secret_key: SecretStr = SecretStr("")
    region: str = "us-east-1"
    input_bucket: str = "llmbatch-input"
    results_bucket: str = "llmbatch-results"
    # input_uri values may only name these buckets (plus input_bucket); empty = input_bucket only
    allowed_input_buckets: list[str] = Field(default_factory=list)
    ca_file: Path | None = Field(
        default=None,
        description="CA bundle to verify an https:// endpoint (default: the system's). The same path must "
        "hold it on the Ray nodes (jobs and the batch runner get LLMBATCH_S3__CA_FILE).",
    )

    @field_validator("endpoint")
    @classmethod
    def _endpoint_scheme(cls, value: str) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError("LLMBATCH_S3__ENDPOINT must be a URL such as http://127.0.0.1:9000")
        return value.rstrip("/")

    @property
    def secure(self) -> bool:
        return self.endpoint.startswith("https://")

    @property
    def host(self) -> str:
        """``host:port`` without scheme, as the minio SDK and pyarrow want it."""
        return self.endpoint.split("://", 1)[1]

    def readable_buckets(self) -> set[str]:
        return {self.input_bucket, *self.allowed_input_buckets}


class RaySettings(BaseModel):
    """Where the Ray Jobs API is (a local head or a KubeRay head service) and how to reach it."""

    address: str = "http://127.0.0.1:8265"
    auth_token: SecretStr | None = None
    serve_address: str = Field(
        default="http://127.0.0.1:8000",
        description="Ray Serve's HTTP proxy (the batch runner of the short path). A loopback host "
        "makes the proxy listen on 127.0.0.1 only, any other host on 0.0.0.0. https:// makes the proxy "
        "speak TLS only, with serve_ssl_certfile and serve_ssl_keyfile.",
    )
    ca_file: Path | None = Field(
        default=None,
        description="CA bundle to verify https:// Ray addresses (the Jobs API and Serve's proxy; default: "
        "the system's).",
    )
    serve_ssl_certfile: str | None = Field(
        default=None,
        description="Path ON THE RAY HEAD of the certificate (chain) Serve's HTTP proxy presents when "
        "serve_address is https:// (it must name serve_address's host).",
    )
    serve_ssl_keyfile: str | None = Field(
        default=None,
        description="Path ON THE RAY HEAD of serve_ssl_certfile's private key.",
    )
    runner_token: SecretStr | None = Field(
        default=None,
        description="The batch runner's API credential (at least 32 characters, e.g. `openssl rand -hex "
        "32`): the dispatcher sends it, the runner's Ray nodes hold the same value in their environment "
        "under this very name (one Secret for both). A dispatcher with the short path on refuses to "
        "start without it; a runner whose nodes lack it answers no one.",
    )
    # optional: `ray://` client address is NOT used; jobs go through the HTTP Jobs API only

    @field_validator("address", "serve_address")
    @classmethod
    def _http_url(cls, value: str, info: ValidationInfo) -> str:
        if not value.startswith(("http://", "https://")):
            raise ValueError(
                f"LLMBATCH_RAY__{str(info.field_name).upper()} must be an http:// or https:// "
                "URL such as http://127.0.0.1:8265"
            )
        return value.rstrip("/")

    @field_validator("runner_token")
    @classmethod
    def _runner_token_long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError(
                "LLMBATCH_RAY__RUNNER_TOKEN must be at least 32 characters (e.g. `openssl rand -hex 32`)"
            )
        return value

    @model_validator(mode="after")
    def _serve_tls_files(self) -> RaySettings:
        files = (self.serve_ssl_certfile, self.serve_ssl_keyfile)
        https = self.serve_address.startswith("https://")
        if https and None in files:
            raise ValueError(
                "LLMBATCH_RAY__SERVE_ADDRESS is https://: set LLMBATCH_RAY__SERVE_SSL_CERTFILE "
                "and LLMBATCH_RAY__SERVE_SSL_KEYFILE (paths on the Ray head), or use http://"
            )
        if not https and files != (None, None):
            raise ValueError(
                "LLMBATCH_RAY__SERVE_SSL_CERTFILE/_KEYFILE need an https:// LLMBATCH_RAY__SERVE_ADDRESS"
            )
        return self


class ReplaySettings(BaseModel):
    """Who may replay dead letters (``LLMBATCH_REPLAY__KEY``)."""

    key: SecretStr | None = Field(
        default=None,
        description="A shared secret (at least 32 characters) of the operators' `llmbatch dlq replay` and "
        "the dispatchers: a replay is signed with it (HMAC-SHA256, header llmbatch-replay-sig) and the "
        "dispatcher dead-letters replay headers it cannot verify. Unset: replay headers are honoured from "
        "any producer that may write the requests topic (the dispatcher says so as it starts).",
    )

    @field_validator("key")
    @classmethod
    def _long_enough(cls, value: SecretStr | None) -> SecretStr | None:
        if value is not None and len(value.get_secret_value()) < 32:
            raise ValueError("must be at least 32 characters (e.g. `openssl rand -hex 32`), or unset")
        return value

    def key_bytes(self) -> bytes | None:
        """The key as bytes, or ``None`` when unset."""
        return None if self.key is None else self.key.get_secret_value().encode()


class LLMBatchSettings(BaseSettings):
    """Root settings object: ``LLMBatchSettings()`` reads the environment."""

    model_config = SettingsConfigDict(
        env_prefix="LLMBATCH_",
        env_nested_delimiter="__",
        env_file=".env",
        env_file_encoding="utf-8",
        extra="ignore",
    )

    kafka: KafkaSettings = KafkaSettings()
    redis: RedisSettings = RedisSettings()
    s3: S3Settings = S3Settings()
    ray: RaySettings = RaySettings()
    replay: ReplaySettings = ReplaySettings()
    tenants: TenantSettings = TenantSettings()
    webhooks: WebhookSettings = WebhookSettings()
    retention: RetentionSettings = RetentionSettings()


def parse_env_file(path: Path) -> dict[str, str]:
    """``KEY=VALUE`` lines as compose and kustomize's configMapGenerator read them (comments and blank
    lines skipped, the value taken as it is); raises ValueError naming the line."""
    values: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{path}:{n}: not KEY=VALUE: {line!r}")
        if key in values:
            raise ValueError(f"{path}:{n}: {key} set twice")
        values[key] = value
    return values
