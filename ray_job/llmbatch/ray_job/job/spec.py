"""Loading the job spec from the command line (``--spec-json``, ``--spec-b64``, ``--spec-file``,
``--spec-uri``) and validating it with :class:`llmbatch.schemas.job.JobSpec`.

``--spec-b64`` is URL-safe base64 of the JSON, optionally zlib-compressed (what
:func:`llmbatch.ray_job.job.submit.entrypoint` produces: no shell quoting issues, shorter command lines).
``--spec-uri s3://...`` reads the spec from an object, for specs too large for a command line
(inline requests near their size limit). ``--s3-session-key`` / ``--s3-session-redis`` name the
attempt's S3 session in Redis (:mod:`llmbatch.ray_job.storage.s3_session`); the spec is read after it, with
its keys.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import zlib
from pathlib import Path

from llmbatch.ray_job.engines.backends import backend_class
from llmbatch.ray_job.errors import InvalidSpecError
from llmbatch.ray_job.storage import s3
from llmbatch.schemas.errors import SchemaError
from llmbatch.schemas.job import JobSpec, S3Session, parse_job_spec


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m llmbatch.ray_job", description="Run one attempt of an llmbatch batch."
    )
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--spec-json", help="the JobSpec as JSON")
    group.add_argument("--spec-b64", help="the JobSpec JSON, URL-safe base64 (optionally zlib-compressed)")
    group.add_argument("--spec-file", type=Path, help="a file holding the JobSpec JSON")
    group.add_argument("--spec-uri", help="an s3:// object holding the JobSpec JSON")
    p.add_argument("--s3-session-key", help="the Redis key of the attempt's S3 session (taken once)")
    p.add_argument("--s3-session-redis", help="the Redis URL (no password) holding --s3-session-key")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parsed command line; :class:`InvalidSpecError` when it is unusable."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help: the usage was the answer
            raise
        raise InvalidSpecError(f"bad command line (exit {exc.code}): see usage above") from None
    if (args.s3_session_key is None) != (args.s3_session_redis is None):
        raise InvalidSpecError("--s3-session-key and --s3-session-redis go together: give both or neither")
    return args


def decode_b64(text: str) -> bytes:
    """URL-safe base64 (padding optional) of JSON or of zlib-compressed JSON -> JSON bytes."""
    try:
        raw = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except (binascii.Error, ValueError) as exc:
        raise InvalidSpecError(f"--spec-b64 is not base64: {exc}") from None
    if raw[:1] in (b"{", b" ", b"\n"):
        return raw
    try:
        return zlib.decompress(raw)
    except zlib.error as exc:
        raise InvalidSpecError(f"--spec-b64 is neither JSON nor zlib-compressed JSON: {exc}") from None


def raw_spec(args: argparse.Namespace, session: S3Session | None = None) -> bytes:
    """The spec bytes named by the parsed arguments (``--spec-uri`` read with ``session``'s keys when
    given)."""
    if args.spec_json is not None:
        return str(args.spec_json).encode()
    if args.spec_b64 is not None:
        return decode_b64(args.spec_b64)
    if args.spec_file is not None:
        try:
            return Path(args.spec_file).read_bytes()
        except OSError as exc:
            raise InvalidSpecError(f"cannot read --spec-file: {exc}") from None
    try:
        data = s3.read_bytes(s3.filesystem(session), s3.path_of(args.spec_uri))
    except (OSError, ValueError) as exc:
        raise InvalidSpecError(f"cannot read --spec-uri: {exc}") from None
    if data is None:
        raise InvalidSpecError(f"--spec-uri {args.spec_uri} does not exist")
    return data


def load(argv: list[str] | None = None) -> JobSpec:
    """Parse the command line and validate the spec; :class:`InvalidSpecError` when it is unusable."""
    return load_spec(parse_args(argv))


def load_spec(args: argparse.Namespace, session: S3Session | None = None) -> JobSpec:
    """The validated spec the parsed command line names; :class:`InvalidSpecError` when unusable."""
    data = raw_spec(args, session)
    try:
        spec = parse_job_spec(data)
    except SchemaError as exc:
        raise InvalidSpecError(f"invalid job spec: {exc}") from None
    backend_class(spec.engine.backend)  # a plug-in that cannot be imported here: the spec's fault
    return spec
