"""From a consumed record to a command (pure): accept a batch, cancel one, or dead-letter the record.

Nothing here touches Kafka or Redis; the consumer applies the commands. Validation uses
:mod:`llmbatch.schemas` (envelope, data, inline limits, deadline) plus the dispatcher's own rules: the
``model`` must be one the service serves (its engine registry, ``LLMBATCH_ENGINES__MODELS``), and an
``input_uri`` may only name a readable bucket (those checks, and the tenant's and replay's signatures,
are :mod:`llmbatch.dispatcher.intake.intake_checks`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import orjson

from llmbatch.dispatcher.domain.batch_record import IntakeItem
from llmbatch.dispatcher.domain.dlt import (
    DeadLetter,
    OriginalRecord,
    build_dead_letter,
    describe_schema_error,
    exception_fqcn,
    reason_for_schema_error,
    without_value,
)
from llmbatch.dispatcher.domain.keys import BatchKey, batch_key
from llmbatch.dispatcher.domain.quota import estimate_inline, over_limit_message, over_storage_message
from llmbatch.dispatcher.domain.retention import retention_s
from llmbatch.dispatcher.domain.scheduler import ready_score
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.intake.intake_checks import (
    check_replay_signed,
    check_served,
    check_tenant_prefix,
    check_tenant_signed,
    claimed_tenant,
)
from llmbatch.dispatcher.kafka.request_body import body_fields
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.schemas.batch import (
    BatchRequest,
    CancelRequest,
    InlineLimits,
    check_deadline,
    check_inline_limits,
)
from llmbatch.schemas.cloudevents import H_ID, H_SOURCE, decode
from llmbatch.schemas.common import BATCH_ID_PATTERN, TENANT_PATTERN
from llmbatch.schemas.dlt import DltReason, ReplayInfo
from llmbatch.schemas.errors import Reason, SchemaError
from llmbatch.schemas.events import REQUEST_EVENT_TYPES
from llmbatch.settings.retention import RetentionSettings
from llmbatch.settings.tenants import limit_of

_BATCH_ID_RE = re.compile(BATCH_ID_PATTERN)
_TENANT_RE = re.compile(TENANT_PATTERN)


@dataclass(frozen=True)
class IntakeRules:
    """Settings-dependent validation rules."""

    requests_topic: str
    dlt_topic: str
    group_id: str
    served_models: frozenset[str]
    """The models requests may name (the registry's keys); any other is ``model_not_found``."""
    pooling_models: frozenset[str] = frozenset()
    """The served models that embed (``/v1/embeddings`` only); the others generate text."""
    inline_limits: InlineLimits = field(default_factory=InlineLimits)
    readable_buckets: frozenset[str] = frozenset()
    inputs_under_tenant_prefix: bool = False
    """An input_uri must name an object under ``<bucket>/<tenant>/``."""
    request_in_redis_max_bytes: int = 1 << 30
    """Larger request records are kept in Redis by coordinates only (see dispatcher.request_body)."""
    replay_key: bytes | None = field(default=None, repr=False)
    """Replay headers must be signed with it (``LLMBATCH_REPLAY__KEY``); ``None``: honoured unsigned."""
    tenant_keys: Mapping[str, bytes] = field(default_factory=dict, repr=False)
    """Tenant -> key (``LLMBATCH_TENANTS__KEYS``): requests and cancels must be signed with the key of
    the tenant they name; empty: tenant claims are trusted."""
    token_limits: Mapping[str, int] = field(default_factory=dict)
    """Tenant (or ``*``) -> its limit of enqueued tokens (``LLMBATCH_TENANTS__MAX_ENQUEUED_TOKENS``)."""
    retention: RetentionSettings = field(default_factory=RetentionSettings)
    """How long a batch's results are kept after it ends, unless its request says
    (``LLMBATCH_RETENTION__*``)."""

    storage_limits: Mapping[str, int] = field(default_factory=dict)
    """Tenant (or ``*``) -> the bytes it may keep (``LLMBATCH_TENANTS__MAX_STORED_BYTES``)."""

    def token_limit(self, tenant: str) -> int | None:
        return limit_of(self.token_limits, tenant)

    def storage_limit(self, tenant: str) -> int | None:
        return limit_of(self.storage_limits, tenant)


def intake_rules(settings: DispatcherSettings) -> IntakeRules:
    """The rules the dispatcher's settings imply (the consumer's, and the reconcile pass's)."""
    topics = settings.kafka.topics
    opts = settings.dispatcher
    return IntakeRules(
        requests_topic=topics.requests,
        dlt_topic=topics.dead_letter,
        group_id=opts.group_id,
        served_models=settings.served_models,
        pooling_models=settings.pooling_models,
        inline_limits=opts.inline_limits,
        readable_buckets=frozenset(settings.s3.readable_buckets()),
        inputs_under_tenant_prefix=opts.inputs_under_tenant_prefix,
        request_in_redis_max_bytes=opts.request_in_redis_max_bytes,
        replay_key=settings.replay.key_bytes(),
        tenant_keys=settings.tenants.key_bytes(),
        token_limits=settings.tenants.max_enqueued_tokens,
        storage_limits=settings.tenants.max_stored_bytes,
        retention=settings.retention,
    )


@dataclass(frozen=True)
class Accept:
    """Create the batch (or reopen a dead-lettered / replayed-failed one)."""

    item: IntakeItem
    request: BatchRequest
    traceparent: str | None
    origin: OriginalRecord


@dataclass(frozen=True)
class Cancel:
    batch_id: str
    request: CancelRequest
    marker: tuple[str, str]
    traceparent: str | None
    origin: OriginalRecord

    @property
    def key(self) -> BatchKey:
        """The batch it cancels: its tenant's batch of that id."""
        return batch_key(self.request.tenant, self.batch_id)


@dataclass(frozen=True)
class Reject:
    """Dead-letter the record; when its batch id, source and id are readable, also record the
    batch as ``dead_lettered`` (if it does not exist) and remember the event id. When the batch id
    is readable (the record key), the request is answered with a ``rejected`` event."""

    dead_letter: DeadLetter
    item: IntakeItem | None
    error: SchemaError
    origin: OriginalRecord
    marker: tuple[str, str]
    batch_id: str | None = None
    request_id: str | None = None
    request_source: str | None = None
    tenant: str | None = None  # the tenant it claims (see claimed_tenant), when readable

    @property
    def key(self) -> BatchKey | None:
        """The batch it names (the claimed tenant's, else the default tenant's), if readable."""
        return batch_key(self.tenant, self.batch_id) if self.batch_id else None

    @property
    def answer_of(self) -> str:
        """What the ``rejected`` answer answers: this record (a redelivery is answered alike)."""
        return ":".join(self.marker)


Command = Accept | Cancel | Reject


def _header(origin: OriginalRecord, name: str) -> str | None:
    for key, value in reversed(origin.headers):
        if key == name:
            try:
                return value.decode("utf-8")
            except UnicodeDecodeError:
                return None
    return None


def _readable_batch_id(origin: OriginalRecord) -> str | None:
    if origin.key is None:
        return None
    try:
        text = origin.key.decode("utf-8")
    except UnicodeDecodeError:
        return None
    return text if _BATCH_ID_RE.fullmatch(text) else None


def _marker(source: str, event_id: str, replay: ReplayInfo | None) -> tuple[str, str]:
    return source, event_id if replay is None else f"{event_id}#replay:{replay.replay_id}"


def _bucket(uri: str) -> str:
    return uri[5:].split("/", 1)[0]


def _reject(origin: OriginalRecord, error: SchemaError, rules: IntakeRules, now: float) -> Reject:
    reason = reason_for_schema_error(error)
    letter = build_dead_letter(
        origin,
        dlt_topic=rules.dlt_topic,
        reason=reason,
        group_id=rules.group_id,
        fqcn=exception_fqcn(error),
        message=describe_schema_error(error),
    )
    batch_id = _readable_batch_id(origin)
    source, event_id = _header(origin, H_SOURCE), _header(origin, H_ID)
    source = source if source and len(source) <= 1024 else None
    event_id = event_id if event_id and len(event_id) <= 256 else None
    item = None
    marker = record_marker(origin)
    tenant = claimed_tenant(origin.value) if batch_id else None
    if batch_id and source and event_id:
        item = IntakeItem(
            key=batch_key(tenant, batch_id),
            fields={
                "batch_id": batch_id,
                # whose it claims to be, as for an accepted request (`llmbatch jobs` shows it)
                **({"tenant": tenant} if tenant else {}),
                "rejected_at": repr(now),
                "dlt_reason": str(reason),
                "error_code": error.reason,
                "error_message": describe_schema_error(error)[:2000],
                "source": source,
                "event_id": event_id,
                # coordinates and headers only: the value is in the dead letter (and the topic)
                "origin": without_value(origin).to_json(),
            },
            marker=marker,
            initial=State.DEAD_LETTERED,
        )
    return Reject(
        letter,
        item,
        error,
        origin,
        marker,
        batch_id=batch_id,
        request_id=event_id,
        request_source=source,
        tenant=tenant,
    )


def over_quota_reject(accept: Accept, rules: IntakeRules, now: float, quota: tuple[int, int, int]) -> Reject:
    """The refusal of an accepted-looking request whose tokens would pass its tenant's limit (the intake
    script found it so and wrote nothing): dead-lettered and answered ``token_limit_exceeded``."""
    used, estimate, limit = quota
    error = SchemaError(
        Reason.TOKEN_LIMIT_EXCEEDED, over_limit_message(accept.request.tenant, estimate, used, limit)
    )
    return _reject(accept.origin, error, rules, now)


def over_storage_reject(accept: Accept, rules: IntakeRules, now: float, used: int, limit: int) -> Reject:
    """The refusal of a request whose tenant keeps more than its stored-bytes limit (as last measured):
    dead-lettered and answered ``storage_quota_exceeded``; nothing was written."""
    error = SchemaError(
        Reason.STORAGE_QUOTA_EXCEEDED, over_storage_message(accept.request.tenant, used, limit)
    )
    return _reject(accept.origin, error, rules, now)


def record_marker(origin: OriginalRecord) -> tuple[str, str]:
    """Dedupe key of one Kafka record (for rejected records: only an exact redelivery is skipped;
    two different records that reuse an event id are both dead-lettered)."""
    return "record", f"{origin.topic}:{origin.partition}:{origin.offset}:{origin.timestamp_ms}"


def classify(origin: OriginalRecord, rules: IntakeRules, now: float) -> Command:
    """Decide what to do with one record of the requests topic. Never raises for bad input."""
    try:
        envelope = decode(origin.key, origin.value, origin.headers, expect=REQUEST_EVENT_TYPES)
        replay = ReplayInfo.from_headers(envelope.extra_headers)
        if replay is not None and rules.replay_key is not None:
            check_replay_signed(replay, rules.replay_key, envelope.source, envelope.id)
        if rules.tenant_keys:
            check_tenant_signed(envelope, origin.value or b"", rules.tenant_keys)
        marker = _marker(envelope.source, envelope.id, replay)
        data = envelope.data
        if isinstance(data, CancelRequest):
            return Cancel(data.batch_id, data, marker, envelope.traceparent, origin)
        if not isinstance(data, BatchRequest):  # pragma: no cover - decode(expect=...) guarantees it
            raise SchemaError(Reason.UNSUPPORTED_TYPE, f"unexpected data {type(data).__name__}")
        check_served(data, rules.served_models, rules.pooling_models)
        check_inline_limits(data, rules.inline_limits)
        accepted_at = datetime.fromtimestamp(now, UTC)
        check_deadline(data, accepted_at)
        if (
            data.input_uri is not None
            and rules.readable_buckets
            and _bucket(data.input_uri) not in rules.readable_buckets
        ):
            raise SchemaError(
                Reason.LIMIT_EXCEEDED,
                f"bucket {_bucket(data.input_uri)!r} is not readable by the dispatcher; "
                f"allowed: {', '.join(sorted(rules.readable_buckets))}",
                field="input_uri",
            )
        if data.input_uri is not None and rules.inputs_under_tenant_prefix:
            check_tenant_prefix(data.input_uri, data.tenant)
        deadline = data.effective_deadline(accepted_at).timestamp()
        item = IntakeItem(
            key=batch_key(data.tenant, data.batch_id),
            fields=intake_fields(
                data,
                origin,
                envelope.source,
                envelope.id,
                envelope.traceparent,
                now,
                body_max_bytes=rules.request_in_redis_max_bytes,
                retention_s=retention_s(rules.retention, data.tenant, data.output_expires_after),
            ),
            marker=marker,
            initial=State.QUEUED,
            ready_score=ready_score(data.priority, deadline),
            deadline=deadline,
            replay_id=replay.replay_id if replay else None,
            # a file batch's estimate needs its size: the intake reads it (only under a limit)
            tokens=estimate_inline(line.body for line in data.requests) if data.requests else 0,
            token_limit=rules.token_limit(data.tenant),
        )
        return Accept(item, data, envelope.traceparent, origin)
    except SchemaError as error:
        return _reject(origin, error, rules, now)
    except Exception as exc:  # a decoder bug must not block the partition either
        internal = SchemaError(Reason.INVALID_FIELD, f"unexpected {type(exc).__name__}: {exc}"[:500])
        result = _reject(origin, internal, rules, now)
        letter = build_dead_letter(
            origin,
            dlt_topic=rules.dlt_topic,
            reason=DltReason.INTERNAL_ERROR,
            group_id=rules.group_id,
            fqcn=exception_fqcn(exc),
            message=str(exc)[:2000],
        )
        return dataclasses.replace(result, dead_letter=letter)


def intake_fields(
    request: BatchRequest,
    origin: OriginalRecord,
    source: str,
    event_id: str,
    traceparent: str | None,
    now: float,
    *,
    body_max_bytes: int = 1 << 30,
    retention_s: int = 0,
) -> dict[str, str]:
    """What the batch hash stores at acceptance. The original value (the job input for inline batches
    and the payload of a later dead letter) is kept verbatim in ``request`` when it is at most
    ``body_max_bytes``, else only described (:func:`llmbatch.dispatcher.kafka.request_body.body_fields`),
    until the
    terminal event is published (``dispatcher/llmbatch/dispatcher/state/lua/mark_published.lua`` deletes it
    then). ``retention_s`` (when not 0): how long its results are kept after it ends (the publish of its
    end dates them in the retention index)."""
    value = origin.value or b""
    stripped = without_value(origin)
    fields: dict[str, Any] = {
        "batch_id": request.batch_id,
        "tenant": request.tenant,
        "model": request.model,
        "endpoint": request.endpoint.value,
        "priority": request.priority,
        "accepted_at": repr(now),
        **body_fields(value, body_max_bytes),
        "origin": stripped.to_json(),
        "source": source,
        "event_id": event_id,
        "metadata": orjson.dumps(request.metadata).decode(),
        "attempt": 0,
        "lifecycle": lifecycle_of(origin, source, event_id),
    }
    if request.input_uri:
        fields["input_uri"] = request.input_uri
    if request.request_count is not None:
        fields["total"] = request.request_count
    if traceparent:
        fields["traceparent"] = traceparent
    if retention_s:
        fields["retention_s"] = retention_s
    return {k: str(v) for k, v in fields.items()}


def lifecycle_of(origin: OriginalRecord, source: str, event_id: str) -> str:
    """The id of the lifecycle a request starts (10 hex digits), fixed by the record that carries it:
    a redelivery of the record names the same lifecycle, any other record (the same batch id sent
    again after its record expired) another one. It goes into the results prefix and the Ray
    submission ids, so a later lifecycle never meets the jobs or shards of an earlier one. A reopen
    (operator replay) keeps the lifecycle of the batch it reopens (see the intake script)."""
    where = f"{origin.topic}\x1f{origin.partition}\x1f{origin.offset}\x1f{origin.timestamp_ms}"
    return hashlib.blake2b(f"{where}\x1f{source}\x1f{event_id}".encode(), digest_size=5).hexdigest()
