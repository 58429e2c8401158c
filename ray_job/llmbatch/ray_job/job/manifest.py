"""The manifest (``<output_prefix>manifest.json``), written last and overwritten by each attempt.

It lists the final shards of ALL attempts (earlier attempts' shards plus this one's), the batch
totals over them, the attempt history and this attempt's timings. Readers trust only the shards
it lists.
"""

from __future__ import annotations

import logging
from datetime import datetime
from typing import Literal

from pyarrow import fs as pafs

from llmbatch.ray_job.job.resume import Prior
from llmbatch.ray_job.storage import s3
from llmbatch.schemas.common import BatchStatus
from llmbatch.schemas.errors import SchemaError
from llmbatch.schemas.job import AttemptRecord, Manifest, ShardInfo, Timings, parse_manifest, submission_id
from llmbatch.schemas.openai import ErrorObject, RequestCounts, Usage

log = logging.getLogger("ray_job.manifest")

Status = Literal["completed", "partial", "failed"]


def read_previous(fs: pafs.FileSystem, path: str) -> Manifest | None:
    """The manifest an earlier attempt wrote, if any (an unreadable one is ignored)."""
    try:
        data = s3.read_bytes(fs, path)
    except OSError as exc:
        log.warning("cannot read the previous manifest: %s", exc)
        return None
    if data is None:
        return None
    try:
        return parse_manifest(data)
    except SchemaError as exc:
        log.warning("ignoring an unreadable previous manifest: %s", exc)
        return None


def history(
    batch_id: str,
    previous: Manifest | None,
    prior: Prior,
    current: AttemptRecord,
    lifecycle: str | None = None,
) -> list[AttemptRecord]:
    """Attempt records: the previous manifest's, attempts known only from their shards, this one."""
    records = {r.attempt: r for r in (previous.attempts if previous else []) if r.attempt != current.attempt}
    for attempt, (completed, failed) in prior.per_attempt().items():
        if attempt not in records and attempt != current.attempt:
            records[attempt] = AttemptRecord(
                attempt=attempt,
                submission_id=submission_id(batch_id, attempt, lifecycle),
                status=BatchStatus.FAILED,
                completed=completed,
                failed=failed,
                error=ErrorObject(
                    code="attempt_lost", message="the attempt ended without writing a manifest"
                ),
            )
    records[current.attempt] = current
    return [records[k] for k in sorted(records)]


def build(
    *,
    batch_id: str,
    attempt: int,
    status: Status,
    total: int | None,
    shards: list[ShardInfo],
    usage: Usage,
    attempts: list[AttemptRecord],
    started_at: datetime,
    finished_at: datetime,
    engine_start_s: float | None,
    generation_s: float | None,
    error: ErrorObject | None = None,
) -> Manifest:
    """A manifest over ``shards`` (counts are their line counts; ``total`` when known)."""
    outputs = [s for s in shards if _kind(s) == "output"]
    errors = [s for s in shards if _kind(s) == "error"]
    completed, failed = sum(s.lines for s in outputs), sum(s.lines for s in errors)
    ended = completed + failed
    counts = RequestCounts(
        total=ended if status != "partial" or total is None else max(total, ended),
        completed=completed,
        failed=failed,
    )
    return Manifest(
        batch_id=batch_id,
        attempt=attempt,
        status={"completed": BatchStatus.COMPLETED, "failed": BatchStatus.FAILED}.get(status, "partial"),
        request_counts=counts,
        usage=usage,
        output_shards=outputs,
        error_shards=errors,
        attempts=attempts,
        timings=Timings(
            started_at=started_at,
            finished_at=finished_at,
            engine_start_s=engine_start_s,
            generation_s=generation_s,
        ),
        error=error,
    )


def _kind(shard: ShardInfo) -> str:
    name = shard.uri.rsplit("/", 1)[-1]
    return "output" if name.startswith("output-") else "error"


def write(fs: pafs.FileSystem, path: str, manifest: Manifest) -> None:
    s3.write_bytes(fs, path, manifest.to_json())
