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
import re
from collections.abc import Iterator

from pyarrow import fs as pafs

from llmbatch.ray_job.errors import InfraUnavailableError, InputNotFoundError
from llmbatch.ray_job.storage import node_secrets
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


_REFUSED_CODES = frozenset(
    {
        # pyarrow's names (the AWS SDK's error enum) ...
        "ACCESS_DENIED",
        "NO_SUCH_BUCKET",
        "NO_SUCH_KEY",
        "RESOURCE_NOT_FOUND",
        # ... and S3's own, in pyarrow's "[code N]: <Code>" form
        "AccessDenied",
        "NoSuchBucket",
        "NoSuchKey",
    }
)
_AWS_CODE = (
    re.compile(r"AWS Error ([A-Z_]+) during [A-Za-z]+"),
    re.compile(r"AWS Error \[code \d+\]: ([A-Za-z]+)"),
)


def s3_error_code(error_text: str, *known: str) -> str | None:
    """The S3 error code in a pyarrow error's text (``AWS Error ACCESS_DENIED during HeadObject
    operation: ...``), or None. ``known``: the bucket and key the call named, taken out of the text
    first (as pyarrow quotes them), so a name that looks like an error (a key with ``403`` or
    ``AWS Error X during`` in it) is never read as one."""
    for name in sorted(known, key=len, reverse=True):
        if name:  # pyarrow quotes the names it gives
            error_text = error_text.replace(f"'{name}'", "''")
    for pattern in _AWS_CODE:
        found = pattern.search(error_text)
        if found is not None:
            return found.group(1)
    return None


def is_refusal(error: OSError | str, *known: str) -> bool:
    """Whether an S3 error says the object is missing or forbidden (an answer about the batch's
    input, not an outage): pyarrow's ``FileNotFoundError``, or an error code of a refusal."""
    if isinstance(error, FileNotFoundError):
        return True
    return s3_error_code(str(error), *known) in _REFUSED_CODES


def _unreadable(path: str, exc: OSError) -> InputNotFoundError | InfraUnavailableError:
    bucket, _, key = path.partition("/")
    text = str(exc)
    if is_refusal(exc, path, bucket, key):
        return InputNotFoundError(f"cannot read s3://{path}: {text[:300]}")
    return InfraUnavailableError(f"S3 did not serve s3://{path}: {text[:300]}")


def check_readable(fs: pafs.FileSystem, path: str) -> int:
    """Size of the object at ``path``; :class:`InputNotFoundError` when it is missing or forbidden,
    :class:`InfraUnavailableError` when S3 did not answer as it should (an outage: the attempt is
    retried without counting against the batch's attempts)."""
    try:
        info = fs.get_file_info(path)
    except OSError as exc:
        raise _unreadable(path, exc) from exc
    if info.type != pafs.FileType.File:
        raise InputNotFoundError(f"s3://{path} does not exist (or is not an object)")
    try:
        with fs.open_input_stream(path) as stream:
            stream.read(1)
    except OSError as exc:
        raise _unreadable(path, exc) from exc
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
