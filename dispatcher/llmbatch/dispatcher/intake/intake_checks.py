"""The dispatcher's own admission checks beyond the schemas (pure): a request's model is served
here for its endpoint, its input lies under its tenant's prefix, it is signed by the tenant it names,
and a replay is signed by an operator. Each raises :class:`SchemaError` naming the field and the fix;
:func:`llmbatch.dispatcher.intake.commands.classify` turns that into a dead letter and an answer.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import orjson

from llmbatch.dispatcher.settings import ENGINES_ENV
from llmbatch.schemas.batch import BatchRequest, CancelRequest
from llmbatch.schemas.cloudevents import Envelope
from llmbatch.schemas.common import TENANT_PATTERN
from llmbatch.schemas.dlt import REPLAY_SIG, ReplayInfo
from llmbatch.schemas.engines import UnknownModelError
from llmbatch.schemas.errors import Reason, SchemaError
from llmbatch.schemas.tenant_auth import TENANT_SIG, verify_tenant_signature

_TENANT_RE = re.compile(TENANT_PATTERN)


def claimed_tenant(value: bytes | None) -> str | None:
    """The tenant a request's record value names (the value is the event's data: its ``tenant``), if
    the value is JSON and that is a valid tenant; ``None`` otherwise (the batch then reads as the
    default tenant's, as an accepted request without one does). For records that did not validate:
    a rejected request, a dead letter."""
    if not value:
        return None
    try:
        data = orjson.loads(value)
    except orjson.JSONDecodeError:
        return None
    tenant = data.get("tenant") if isinstance(data, dict) else None
    return tenant if isinstance(tenant, str) and _TENANT_RE.fullmatch(tenant) else None


def check_tenant_prefix(input_uri: str, tenant: str) -> None:
    """:class:`SchemaError` (field ``input_uri``) unless the object lies under ``<bucket>/<tenant>/``."""
    bucket, _, key = input_uri[5:].partition("/")
    parts = key.split("/")
    if len(parts) < 2 or parts[0] != tenant or any(p in {"", ".", ".."} for p in parts):
        raise SchemaError(
            Reason.INVALID_FIELD,
            f"input_uri must name an object under the tenant's prefix s3://{bucket}/{tenant}/ (the "
            f"producer and the HTTP API upload there); got {input_uri[:300]!r}",
            field="input_uri",
        )


def check_replay_signed(replay: ReplayInfo, key: bytes, source: str, event_id: str) -> None:
    """:class:`SchemaError` (field ``llmbatch-replay-sig``) unless an operator holding the replay key
    replayed this very event: replay headers reopen a failed batch, which no producer may do."""
    if replay.verify(key, source=source, event_id=event_id):
        return
    state = "is not signed" if replay.signature is None else "does not verify"
    raise SchemaError(
        Reason.INVALID_HEADER,
        f"replay {replay.replay_id!r} (by {replay.replayed_by!r}) {state}: only `llmbatch dlq replay` "
        "run with this dispatcher's LLMBATCH_REPLAY__KEY may replay; replay the dead letter with it",
        field=REPLAY_SIG,
    )


def check_tenant_signed(
    envelope: Envelope[BatchRequest | CancelRequest], value: bytes, keys: Mapping[str, bytes]
) -> None:
    """:class:`SchemaError` (field ``llmbatch-tenant-sig``) unless the event is signed with the key of
    the tenant it names (:mod:`llmbatch.schemas.tenant_auth`): no producer acts for a tenant it has no key
    of."""
    tenant = envelope.data.tenant
    what = "cancel" if isinstance(envelope.data, CancelRequest) else "request"
    key = keys.get(tenant)
    if key is None:
        raise SchemaError(
            Reason.INVALID_HEADER,
            f"tenant {tenant!r} has no key on this dispatcher: add it to LLMBATCH_TENANTS__KEYS of the "
            f"dispatchers and of the producers that act for it, then send the {what} again",
            field=TENANT_SIG,
        )
    raw = envelope.header(TENANT_SIG)
    signature = raw.decode(errors="replace") if raw is not None else None
    if verify_tenant_signature(
        key,
        signature,
        event_type=envelope.type.value,
        source=envelope.source,
        event_id=envelope.id,
        tenant=tenant,
        value=value,
    ):
        return
    state = "is not signed" if signature is None else "does not verify"
    raise SchemaError(
        Reason.INVALID_HEADER,
        f"the {what} for tenant {tenant!r} {state}: only a producer holding that tenant's key "
        "(LLMBATCH_TENANTS__KEYS) may act for it; send it again from one",
        field=TENANT_SIG,
    )


def check_served(
    request: BatchRequest, served: frozenset[str], pooling: frozenset[str] = frozenset()
) -> None:
    """Raise ``SchemaError(model_not_found)`` unless ``request.model`` is served here for
    ``request.endpoint``: a batch never runs on another model than the one it names, and an embedding
    model answers only ``/v1/embeddings`` (a text-generation model everything else)."""
    if request.model in served:
        embeds = request.model in pooling
        if embeds == request.endpoint.pooling:
            return
        kind = "an embedding model" if embeds else "a text-generation model"
        fitting = sorted(served & pooling) if request.endpoint.pooling else sorted(served - pooling)
        listed = ", ".join(repr(m) for m in fitting) or "none configured"
        raise SchemaError(
            Reason.MODEL_NOT_FOUND,
            f"model {request.model!r} is {kind}: it does not serve {request.endpoint.value}. Models that "
            f"do: {listed}. Send the batch to one of those, or with an endpoint {request.model!r} serves",
            field="endpoint",
        )
    known = str(UnknownModelError(request.model, sorted(served)))
    other = "Send the batch with one of those models, or serve" if served else "Serve"
    raise SchemaError(
        Reason.MODEL_NOT_FOUND,
        f"{known}. {other} {request.model!r}: add it to the dispatcher's {ENGINES_ENV} "
        f'(model name -> {{"path": ...}}) and replay this dead letter',
        field="model",
    )
