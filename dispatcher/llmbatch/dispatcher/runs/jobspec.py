"""The :class:`llmbatch.schemas.job.JobSpec` of one attempt, built from a batch record (pure).

The spec depends only on the record and the settings, so a resubmission of the same attempt (after
a crash or a head restart) sends the same spec under the same submission id.
"""

from __future__ import annotations

from datetime import UTC, datetime

from llmbatch.dispatcher.domain.batch_record import BatchRecord
from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.schemas.batch import parse_batch_request
from llmbatch.schemas.engines import app_name
from llmbatch.schemas.job import JobSpec, output_prefix


def results_prefix(settings: DispatcherSettings, record: BatchRecord) -> str:
    """Where this lifecycle of the batch keeps its results (see
    :func:`llmbatch.schemas.job.output_prefix`)."""
    return output_prefix(
        settings.s3.results_bucket,
        record.tenant,
        record.batch_id,
        record.get("lifecycle") or None,
    )


def build_job_spec(
    record: BatchRecord, attempt: int, settings: DispatcherSettings, keys: Keys, request: str | None = None
) -> JobSpec:
    """The spec of one attempt; the model's path and engine come from its registry entry. ``request``
    is the request body when the record does not keep it (see :mod:`llmbatch.dispatcher.kafka.request_body`).

    Raises :class:`llmbatch.schemas.errors.SchemaError` if the stored request no longer validates, and
    :class:`llmbatch.schemas.engines.UnknownModelError` if its model left the registry after acceptance (the
    batch must fail rather than run on another model).
    """
    body = request if request is not None else record.get("request")
    parsed = parse_batch_request(body or "{}")
    entry = settings.engines.get(parsed.model)
    job = settings.job
    opts = settings.dispatcher
    deadline = record.deadline
    return JobSpec(
        batch_id=record.batch_id,
        attempt=attempt,
        endpoint=parsed.endpoint,
        model=parsed.model,
        model_path=entry.path,
        tenant=parsed.tenant,
        input_uri=parsed.input_uri,
        requests=parsed.requests,
        output_prefix=results_prefix(settings, record),
        lifecycle=record.get("lifecycle") or None,
        engine=entry.engine,
        pool_resource=settings.tenants.pool_of(parsed.tenant),
        engine_app=app_name(parsed.model) if opts.shared_engines else None,
        engine_wait_s=opts.engine_wait_s,
        # never a password in the spec (command line, uploaded spec): the job gets it from its env
        redis_url=settings.job_redis_url(),
        progress_key=keys.progress(record.key) if job.pass_redis_url else None,
        progress_interval_s=job.progress_interval_s,
        shard_max_lines=job.shard_max_lines,
        shard_max_seconds=job.shard_max_seconds,
        max_line_bytes=job.max_line_bytes,
        deadline=datetime.fromtimestamp(deadline, UTC) if deadline else None,
        priority=parsed.priority,
    )
