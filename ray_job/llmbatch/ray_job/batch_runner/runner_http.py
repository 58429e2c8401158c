"""The batch runner's HTTP contract (see :mod:`llmbatch.ray_job.batch_runner.runner` for the routes): its
Serve application name and route prefix, and the parsing of requests, kept apart from the runner so the
dispatcher imports them without the runner's engine and pipeline modules. Pure."""

from __future__ import annotations

import hmac

import orjson
from pydantic import ValidationError

from llmbatch.schemas.job import JobSpec, RunnerSubmission

APP_NAME = "llmbatch-runner"
ROUTE_PREFIX = "/llmbatch-runner"
MAX_STATUS_IDS = 1000
DEPLOYMENT = "BatchRunner"  # the Serve deployment of APP_NAME


MIN_TOKEN_CHARS = 32


def credential_problem(header: str | None, token: str | None) -> tuple[int, str] | None:
    """``(status, error)`` when a request's ``Authorization`` header does not carry the runner's
    ``token`` (``LLMBATCH_RAY__RUNNER_TOKEN`` of its node), else None. A runner whose node has no token
    (or one too short to be a secret) answers no one: 503, naming the setting."""
    if token is None or len(token) < MIN_TOKEN_CHARS:
        return 503, (
            "this batch runner has no credential: give its Ray nodes LLMBATCH_RAY__RUNNER_TOKEN (at least "
            f"{MIN_TOKEN_CHARS} characters, from the Secret the dispatcher's comes from)"
        )
    scheme, _, sent = (header or "").partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(sent.strip().encode(), token.encode()):
        return 401, (
            "authorization: send 'Authorization: Bearer <LLMBATCH_RAY__RUNNER_TOKEN>' with the token "
            "the batch runner's nodes have"
        )
    return None


def route(method: str, path: str) -> tuple[str, str | None]:
    """``(operation, submission_id)`` of a request; operation ``""`` when the route is unknown.

    ``path`` may carry the route prefix; only the segments from ``runs`` on count."""
    parts = [p for p in path.split("/") if p]
    if method == "GET" and parts and parts[-1] == "engines":
        return "engines", None
    if method == "POST" and parts and parts[-1] == "statuses":
        return "statuses", None
    if "runs" not in parts:
        return "", None
    rest = parts[len(parts) - parts[::-1].index("runs") :]
    if method == "POST" and not rest:
        return "submit", None
    if method == "GET" and len(rest) == 1:
        return "status", rest[0]
    if method == "POST" and len(rest) == 2 and rest[1] == "stop":
        return "stop", rest[0]
    return "", None


def parse_status_ids(raw: bytes) -> list[str]:
    """The ids of a ``POST /statuses`` body; ValueError naming the field and the fix."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        raise ValueError('the body must be JSON: {"submission_ids": ["<id>", ...]}') from None
    ids = data.get("submission_ids") if isinstance(data, dict) else None
    if not isinstance(ids, list) or not all(isinstance(i, str) and 0 < len(i) <= 256 for i in ids):
        raise ValueError("submission_ids: give a list of submission ids (strings of 1-256 characters)")
    if len(ids) > MAX_STATUS_IDS:
        raise ValueError(f"submission_ids: at most {MAX_STATUS_IDS} per request, got {len(ids)}; split them")
    return ids


def parse_submission(raw: bytes) -> RunnerSubmission:
    """A submit request's body: ``{"spec": ..., "s3_session": ...}`` or a bare spec (dispatchers before
    S3 sessions). Raises ValueError naming the fields; its text never holds the values sent (keys)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise ValueError(f"invalid job spec: not JSON ({exc})") from None
    try:
        if isinstance(data, dict) and "spec" in data:
            return RunnerSubmission.model_validate(data)
        return RunnerSubmission(spec=JobSpec.model_validate(data))
    except ValidationError as exc:
        where = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or 'body'}: {e['msg']}"
            for e in exc.errors(include_input=False, include_url=False)
        )
        raise ValueError(f"invalid job spec: {where}") from None
