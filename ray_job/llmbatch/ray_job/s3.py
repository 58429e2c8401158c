"""S3/MinIO access through pyarrow's S3 filesystem, configured from the environment.

- endpoint: ``LLMBATCH_S3__ENDPOINT`` (e.g. ``http://127.0.0.1:9000``), else ``AWS_ENDPOINT_URL_S3``
  / ``AWS_ENDPOINT_URL``, else AWS itself;
- an https endpoint is verified against ``LLMBATCH_S3__CA_FILE`` when set (else the system's CAs);
- credentials: ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY`` (``AWS_SESSION_TOKEN``), else
  pyarrow's default AWS chain; region ``AWS_REGION`` / ``AWS_DEFAULT_REGION`` (default us-east-1).

Every process builds its own filesystem from its own environment (the keys are never in a job's
``runtime_env``); a batch on the shared runner brings its own temporary keys instead
(:class:`llmbatch.schemas.job.S3Session`). Nothing secret is ever logged or pickled.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

from pyarrow import fs as pafs

from llmbatch.ray_job import node_secrets
from llmbatch.ray_job.errors import InputNotFoundError
from llmbatch.schemas.job import S3Session

CHUNK_BYTES = 1 << 20


def endpoint() -> str | None:
    """The configured S3 endpoint URL, if any."""
    for name in ("LLMBATCH_S3__ENDPOINT", "AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"):
        value = os.environ.get(name)
        if value:
            return value.rstrip("/")
    return None


def filesystem(session: S3Session | None = None) -> pafs.S3FileSystem:
    """A pyarrow S3 filesystem for the configured endpoint, with ``session``'s keys when given (a
    runner batch's own, see :class:`llmbatch.schemas.job.S3Session`: never the process's), else the
    configured credentials."""
    kwargs: dict[str, object] = {
        "region": os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1",
        "connect_timeout": 10,
        "request_timeout": 60,
        "retry_strategy": pafs.AwsStandardS3RetryStrategy(max_attempts=5),
    }
    url = endpoint()
    if url:
        scheme, _, host = url.partition("://")
        kwargs.update(endpoint_override=host, scheme=scheme)
    ca_file = os.environ.get("LLMBATCH_S3__CA_FILE")
    if ca_file and url and url.startswith("https://"):
        kwargs["tls_ca_file_path"] = ca_file
    if session is not None:
        kwargs.update(
            access_key=session.access_key.get_secret_value(),
            secret_key=session.secret_key.get_secret_value(),
            session_token=session.session_token.get_secret_value(),
        )
        return pafs.S3FileSystem(**kwargs)
    key, secret = os.environ.get(node_secrets.S3_ACCESS_KEY), os.environ.get(node_secrets.S3_SECRET_KEY)
    if key and secret:
        kwargs.update(
            access_key=key,
            secret_key=secret,
            session_token=os.environ.get(node_secrets.S3_SESSION_TOKEN) or None,
        )
    return pafs.S3FileSystem(**kwargs)


def path_of(uri: str) -> str:
    """``s3://bucket/key`` -> ``bucket/key`` (what pyarrow wants)."""
    if not uri.startswith("s3://"):
        raise ValueError(f"not an s3:// URI: {uri[:80]!r}")
    return uri[5:]


def uri_of(path: str) -> str:
    """``bucket/key`` -> ``s3://bucket/key``."""
    return f"s3://{path}"


_REFUSALS = (
    "NoSuchBucket",
    "NO_SUCH_BUCKET",
    "AccessDenied",
    "ACCESS_DENIED",
    "Forbidden",
    "403",
    "does not exist",
)


def is_refusal(error_text: str) -> bool:
    """Whether an S3 error says the object is missing or forbidden (an answer, not an outage).
    pyarrow names S3's codes its own way (``AWS Error ACCESS_DENIED during HeadObject``)."""
    return any(s in error_text for s in _REFUSALS)


def check_readable(fs: pafs.FileSystem, path: str) -> int:
    """Size of the object at ``path``; :class:`InputNotFoundError` when it is missing or forbidden."""
    try:
        info = fs.get_file_info(path)
    except OSError as exc:
        text = str(exc)
        if is_refusal(text):
            raise InputNotFoundError(f"cannot read s3://{path}: {text[:300]}") from exc
        raise
    if info.type != pafs.FileType.File:
        raise InputNotFoundError(f"s3://{path} does not exist (or is not an object)")
    try:
        with fs.open_input_stream(path) as stream:
            stream.read(1)
    except OSError as exc:
        raise InputNotFoundError(f"cannot read s3://{path}: {str(exc)[:300]}") from exc
    return int(info.size or 0)


def read_chunks(fs: pafs.FileSystem, path: str, chunk: int = CHUNK_BYTES) -> Iterator[bytes]:
    """Stream an object in chunks (never the whole object in memory)."""
    with fs.open_input_stream(path) as stream:
        while True:
            data = stream.read(chunk)
            if not data:
                return
            yield bytes(data)


def read_bytes(fs: pafs.FileSystem, path: str) -> bytes | None:
    """A small object's bytes, or ``None`` when it does not exist."""
    if fs.get_file_info(path).type != pafs.FileType.File:
        return None
    with fs.open_input_stream(path) as stream:
        return bytes(stream.read())


def write_bytes(fs: pafs.FileSystem, path: str, data: bytes) -> None:
    """Create or replace an object (S3 puts are atomic: readers never see half of it)."""
    with fs.open_output_stream(path) as stream:
        stream.write(data)


def list_objects(fs: pafs.FileSystem, prefix_path: str) -> list[pafs.FileInfo]:
    """Objects directly under ``prefix_path`` (a ``bucket/dir/`` path); empty when there are none."""
    selector = pafs.FileSelector(prefix_path.rstrip("/"), allow_not_found=True, recursive=False)
    return [info for info in fs.get_file_info(selector) if info.type == pafs.FileType.File]
