"""llmbatch contracts: pydantic v2 models shared by the producer, the dispatcher and the Ray job.

Imports only pydantic, orjson and the standard library (it ships to Ray workers). Modules:

- :mod:`llmbatch.schemas.errors` - :class:`SchemaError` (the one error type, with ``reason``/``field``).
- :mod:`llmbatch.schemas.common` - constrained ids, names, URIs, :class:`Endpoint`, :class:`BatchStatus`.
- :mod:`llmbatch.schemas.openai` - OpenAI batch input/output lines, request counts, usage.
- :mod:`llmbatch.schemas.request_bodies` - the typed request bodies per endpoint and their limits.
- :mod:`llmbatch.schemas.input_lines` - the per-line parser and the streaming file check.
- :mod:`llmbatch.schemas.batch` - :class:`BatchRequest`, :class:`CancelRequest`, acceptance checks.
- :mod:`llmbatch.schemas.events` - event types, result event data models, the type registry.
- :mod:`llmbatch.schemas.cloudevents` - the CloudEvents binary-mode Kafka codec.
- :mod:`llmbatch.schemas.dlt` - dead-letter and replay headers.
- :mod:`llmbatch.schemas.job` - :class:`JobSpec`, :class:`EngineConfig`, :class:`Manifest`.

``python -m llmbatch.schemas.generate`` regenerates ``schemas/llmbatch/schemas/json/*.schema.json`` and
``schemas/asyncapi.yaml``.
"""

from llmbatch.schemas.batch import (
    DEFAULT_COMPLETION_WINDOW,
    BatchRequest,
    CancelRequest,
    InlineLimits,
    check_deadline,
    check_inline_limits,
    check_submittable,
    parse_batch_request,
)
from llmbatch.schemas.cloudevents import Envelope, decode, encode, stable_event_id
from llmbatch.schemas.common import (
    BatchId,
    BatchStatus,
    Endpoint,
    ExpiresAfter,
    Metadata,
    ModelName,
    S3Prefix,
    S3Uri,
    Tenant,
    format_time,
    parse_duration,
    utcnow,
)
from llmbatch.schemas.dlt import DltReason, DltRecord, ReplayInfo
from llmbatch.schemas.errors import Reason, SchemaError
from llmbatch.schemas.events import (
    EVENT_DATA_MODELS,
    REQUEST_EVENT_TYPES,
    RESULT_EVENT_TYPES,
    TERMINAL_EVENT_TYPES,
    TERMINAL_TYPE_BY_STATUS,
    BatchAccepted,
    BatchCancelled,
    BatchCompleted,
    BatchExpired,
    BatchFailed,
    BatchProgress,
    BatchRejected,
    EventData,
    EventType,
    RecordRef,
    TerminalEventData,
    event_type_for,
)
from llmbatch.schemas.input_lines import (
    InputReport,
    LineResult,
    check_input_lines,
    iter_input_lines,
    parse_input_line,
)
from llmbatch.schemas.job import (
    MANIFEST_NAME,
    AttemptRecord,
    EngineConfig,
    JobSpec,
    Manifest,
    ShardInfo,
    Timings,
    output_prefix,
    parse_job_spec,
    parse_manifest,
    shard_name,
    submission_id,
)
from llmbatch.schemas.openai import (
    BatchInputLine,
    BatchOutputLine,
    ErrorObject,
    RequestCounts,
    ResponseObject,
    Usage,
)
from llmbatch.schemas.request_bodies import ChatCompletionBody, ChatMessage, CompletionBody

__all__ = [
    "DEFAULT_COMPLETION_WINDOW",
    "EVENT_DATA_MODELS",
    "MANIFEST_NAME",
    "REQUEST_EVENT_TYPES",
    "RESULT_EVENT_TYPES",
    "TERMINAL_EVENT_TYPES",
    "TERMINAL_TYPE_BY_STATUS",
    "AttemptRecord",
    "BatchAccepted",
    "BatchCancelled",
    "BatchCompleted",
    "BatchExpired",
    "BatchFailed",
    "BatchId",
    "BatchInputLine",
    "BatchOutputLine",
    "BatchProgress",
    "BatchRejected",
    "BatchRequest",
    "BatchStatus",
    "CancelRequest",
    "ChatCompletionBody",
    "ChatMessage",
    "CompletionBody",
    "DltReason",
    "DltRecord",
    "Endpoint",
    "EngineConfig",
    "Envelope",
    "ErrorObject",
    "EventData",
    "EventType",
    "ExpiresAfter",
    "InlineLimits",
    "InputReport",
    "JobSpec",
    "LineResult",
    "Manifest",
    "Metadata",
    "ModelName",
    "Reason",
    "RecordRef",
    "ReplayInfo",
    "RequestCounts",
    "ResponseObject",
    "S3Prefix",
    "S3Uri",
    "SchemaError",
    "ShardInfo",
    "Tenant",
    "TerminalEventData",
    "Timings",
    "Usage",
    "check_deadline",
    "check_inline_limits",
    "check_input_lines",
    "check_submittable",
    "decode",
    "encode",
    "event_type_for",
    "format_time",
    "iter_input_lines",
    "output_prefix",
    "parse_batch_request",
    "parse_duration",
    "parse_input_line",
    "parse_job_spec",
    "parse_manifest",
    "shard_name",
    "stable_event_id",
    "submission_id",
    "utcnow",
]
