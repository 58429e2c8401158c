"""Generate the checked-in contract artifacts from the models.

``python -m llmbatch.schemas.generate`` writes ``schemas/llmbatch/schemas/json/<message>.schema.json`` (JSON
Schema 2020-12,
one per message type and file format) and ``schemas/asyncapi.yaml`` (AsyncAPI 3.0: the three topics,
their messages, CloudEvents headers and keys). ``--check`` writes nothing and exits 1 when a file
is stale or missing, so CI catches a model change without regenerated artifacts.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from llmbatch.schemas.cloudevents import (
    H_CONTENT_TYPE,
    H_ID,
    H_SOURCE,
    H_SPECVERSION,
    H_SUBJECT,
    H_TIME,
    H_TRACEPARENT,
    H_TYPE,
)
from llmbatch.schemas.common import BATCH_ID_PATTERN
from llmbatch.schemas.dlt import (
    EXCEPTION_FQCN,
    EXCEPTION_MESSAGE,
    ORIGINAL_CONSUMER_GROUP,
    ORIGINAL_HEADERS_DROPPED,
    ORIGINAL_OFFSET,
    ORIGINAL_PARTITION,
    ORIGINAL_TIMESTAMP,
    ORIGINAL_TOPIC,
    ORIGINAL_VALUE_BYTES,
    ORIGINAL_VALUE_SHA256,
    REASON,
    REDUCED,
    REPLAY_AT,
    REPLAY_BY,
    REPLAY_ID,
    DltReason,
)
from llmbatch.schemas.events import EVENT_DATA_MODELS, REQUEST_EVENT_TYPES, EventType
from llmbatch.schemas.job import JobSpec, Manifest
from llmbatch.schemas.openai import BatchInputLine, BatchOutputLine
from llmbatch.schemas.request_bodies import ChatCompletionBody, CompletionBody, EmbeddingBody

CONTRACT_VERSION = "1.0.0"
SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"
PACKAGE_DIR = Path(__file__).resolve().parent
JSON_DIR = PACKAGE_DIR / "json"
ASYNCAPI_PATH = PACKAGE_DIR / "asyncapi.yaml"

REQUESTS_TOPIC = "llm.batch.requests.v1"
RESULTS_TOPIC = "llm.batch.results.v1"
DEAD_LETTER_TOPIC = "llm.batch.requests.v1.dlt"

FILE_FORMATS: dict[str, type[BaseModel]] = {
    "batch-input-line": BatchInputLine,
    "chat-completion-body": ChatCompletionBody,
    "completion-body": CompletionBody,
    "embedding-body": EmbeddingBody,
    "batch-output-line": BatchOutputLine,
    "job-spec": JobSpec,
    "manifest": Manifest,
}
"""Non-event formats that also get a JSON Schema file."""

_MESSAGE_NAMES: dict[EventType, str] = {
    EventType.BATCH_REQUESTED: "batchRequested",
    EventType.CANCEL_REQUESTED: "cancelRequested",
    EventType.ACCEPTED: "batchAccepted",
    EventType.PROGRESS: "batchProgress",
    EventType.COMPLETED: "batchCompleted",
    EventType.FAILED: "batchFailed",
    EventType.CANCELLED: "batchCancelled",
    EventType.EXPIRED: "batchExpired",
    EventType.REJECTED: "batchRejected",
}


def json_schemas() -> dict[str, dict[str, Any]]:
    """``{file stem: JSON Schema}`` for every event type and file format."""
    out: dict[str, dict[str, Any]] = {}
    named: list[tuple[str, type[BaseModel]]] = [(str(t), m) for t, m in EVENT_DATA_MODELS.items()]
    named += list(FILE_FORMATS.items())
    for stem, model in named:
        schema = model.model_json_schema(mode="validation")
        out[stem] = {"$schema": SCHEMA_DIALECT, "$id": f"urn:llmbatch:schema:{stem}", **schema}
    return out


def _ce_headers(event_type: EventType) -> dict[str, Any]:
    return {
        "type": "object",
        "required": [H_SPECVERSION, H_ID, H_SOURCE, H_TYPE, H_TIME, H_SUBJECT, H_CONTENT_TYPE],
        "properties": {
            H_SPECVERSION: {"type": "string", "const": "1.0", "description": "CloudEvents spec version."},
            H_ID: {
                "type": "string",
                "minLength": 1,
                "maxLength": 256,
                "description": "Unique per source; "
                "a re-published terminal event keeps its id so consumers can drop duplicates.",
            },
            H_SOURCE: {"type": "string", "minLength": 1, "description": "URI-reference of the producer."},
            H_TYPE: {"type": "string", "const": str(event_type)},
            H_TIME: {"type": "string", "format": "date-time", "description": "RFC 3339 with offset."},
            H_SUBJECT: {"type": "string", "pattern": BATCH_ID_PATTERN, "description": "The batch_id."},
            H_CONTENT_TYPE: {"type": "string", "const": "application/json"},
            H_TRACEPARENT: {
                "type": "string",
                "pattern": "^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$",
                "description": "Optional W3C trace context.",
            },
        },
    }


def _dlt_headers() -> dict[str, Any]:
    def binary(desc: str) -> dict[str, Any]:
        return {"type": "string", "contentEncoding": "binary", "description": desc}

    return {
        "type": "object",
        "description": "The original record's headers (ce_* included, unchanged) plus these.",
        "required": [ORIGINAL_TOPIC, ORIGINAL_PARTITION, ORIGINAL_OFFSET, REASON],
        "properties": {
            ORIGINAL_TOPIC: {"type": "string"},
            ORIGINAL_PARTITION: binary("4-byte big-endian int (Spring Kafka encoding)."),
            ORIGINAL_OFFSET: binary("8-byte big-endian long (Spring Kafka encoding)."),
            ORIGINAL_TIMESTAMP: binary("8-byte big-endian long, epoch ms (Spring Kafka encoding)."),
            ORIGINAL_CONSUMER_GROUP: {"type": "string"},
            EXCEPTION_FQCN: {
                "type": "string",
                "description": "Error class, e.g. llmbatch.schemas.errors.SchemaError.",
            },
            EXCEPTION_MESSAGE: {"type": "string", "maxLength": 4096},
            REASON: {"type": "string", "enum": [r.value for r in DltReason]},
            REDUCED: {
                "type": "string",
                "const": "true",
                "description": "Set when the dead letter would not fit the dead-letter topic: the value "
                "is left out (null) and so are original headers over 1 KiB; read the original record at "
                "kafka_dlt-original-{topic,partition,offset}.",
            },
            ORIGINAL_VALUE_BYTES: {
                "type": "string",
                "pattern": "^[0-9]+$",
                "description": "Reduced dead letters: the left-out value's size in bytes.",
            },
            ORIGINAL_VALUE_SHA256: {
                "type": "string",
                "pattern": "^[0-9a-f]{64}$",
                "description": "Reduced dead letters: SHA-256 (hex) of the left-out value.",
            },
            ORIGINAL_HEADERS_DROPPED: {
                "type": "string",
                "pattern": "^[0-9]+$",
                "description": "Reduced dead letters: how many original headers were left out.",
            },
            REPLAY_ID: {"type": "string", "description": "Set on records replayed from the DLT."},
            REPLAY_AT: {"type": "string", "format": "date-time"},
            REPLAY_BY: {"type": "string"},
        },
    }


def asyncapi_document() -> dict[str, Any]:
    """The AsyncAPI 3.0 document as a plain dict."""
    models = [(m, "validation") for m in EVENT_DATA_MODELS.values()]
    refs, top = models_json_schema(models, ref_template="#/components/schemas/{model}")  # type: ignore[arg-type]
    schemas: dict[str, Any] = dict(top.get("$defs", {}))
    key_schema = {"type": "string", "pattern": BATCH_ID_PATTERN, "description": "The batch_id (UTF-8)."}
    kafka_key = {"kafka": {"key": key_schema, "bindingVersion": "0.5.0"}}

    messages: dict[str, Any] = {}
    for event_type, model in EVENT_DATA_MODELS.items():
        name = _MESSAGE_NAMES[event_type]
        header_name = f"{name}Headers"
        schemas[header_name] = _ce_headers(event_type)
        messages[name] = {
            "name": str(event_type),
            "title": model.__name__,
            "summary": (model.__doc__ or "").strip().splitlines()[0],
            "contentType": "application/json",
            "headers": {"$ref": f"#/components/schemas/{header_name}"},
            "payload": refs[(model, "validation")],
            "bindings": kafka_key,
        }
    schemas["DeadLetterHeaders"] = _dlt_headers()
    messages["deadLetter"] = {
        "name": "dead-letter",
        "title": "Dead letter",
        "summary": "A request that could not be processed: the original record plus kafka_dlt-* headers.",
        "contentType": "application/json",
        "headers": {"$ref": "#/components/schemas/DeadLetterHeaders"},
        "payload": {"description": "The original record value, byte for byte (it may be invalid)."},
        "bindings": {
            "kafka": {
                "key": {"type": "string", "description": "The original key."},
                "bindingVersion": "0.5.0",
            }
        },
    }

    def channel(address: str, names: list[str], description: str) -> dict[str, Any]:
        return {
            "address": address,
            "description": description + " Topic names are settings; these are the defaults.",
            "messages": {n: {"$ref": f"#/components/messages/{n}"} for n in names},
            "bindings": {"kafka": {"topic": address, "bindingVersion": "0.5.0"}},
        }

    request_names = [_MESSAGE_NAMES[t] for t in EventType if t in REQUEST_EVENT_TYPES]
    result_names = [_MESSAGE_NAMES[t] for t in EventType if t not in REQUEST_EVENT_TYPES]

    def operation(action: str, chan: str, names: list[str], summary: str) -> dict[str, Any]:
        return {
            "action": action,
            "channel": {"$ref": f"#/channels/{chan}"},
            "summary": summary,
            "messages": [{"$ref": f"#/channels/{chan}/messages/{n}"} for n in names],
        }

    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "llmbatch",
            "version": CONTRACT_VERSION,
            "description": "Event-driven LLM batch inference. Events are CloudEvents 1.0 in Kafka binary "
            "mode: the value is the JSON data, attributes are ce_* headers, the key is the batch_id. "
            "Input and output files use the OpenAI Batch API line formats.",
            "license": {"name": "Apache-2.0"},
        },
        "defaultContentType": "application/json",
        "servers": {
            "local": {"host": "127.0.0.1:9092", "protocol": "kafka", "description": "The local stack."}
        },
        "channels": {
            "requests": channel(REQUESTS_TOPIC, request_names, "Commands from upstream services."),
            "results": channel(
                RESULTS_TOPIC, result_names, "Lifecycle events, one terminal event per batch."
            ),
            "deadLetters": channel(
                DEAD_LETTER_TOPIC, ["deadLetter"], "Requests that could not be processed."
            ),
        },
        "operations": {
            "receiveRequests": operation(
                "receive", "requests", request_names, "The dispatcher consumes batch and cancel requests."
            ),
            "sendResults": operation(
                "send",
                "results",
                result_names,
                "The dispatcher publishes accepted, progress and terminal events.",
            ),
            "sendDeadLetters": operation(
                "send", "deadLetters", ["deadLetter"], "Invalid or unprocessable requests are dead-lettered."
            ),
        },
        "components": {"schemas": schemas, "messages": messages},
    }


def render() -> dict[Path, str]:
    """Every artifact path with its expected content."""
    import yaml  # only the generator needs PyYAML; importing schemas does not

    out = {
        JSON_DIR / f"{stem}.schema.json": json.dumps(schema, indent=2, ensure_ascii=False) + "\n"
        for stem, schema in json_schemas().items()
    }
    header = "# Generated by `python -m llmbatch.schemas.generate`; do not edit by hand.\n"
    body = yaml.safe_dump(asyncapi_document(), sort_keys=False, allow_unicode=True, width=110)
    out[ASYNCAPI_PATH] = header + body
    return out


def stale_files() -> list[Path]:
    """Artifacts whose content differs from what the models generate (or that are missing/extra)."""
    expected = render()
    stale = [p for p, text in expected.items() if not p.exists() or p.read_text(encoding="utf-8") != text]
    extra = [p for p in JSON_DIR.glob("*.schema.json") if p not in expected] if JSON_DIR.exists() else []
    return sorted(stale + extra)


def write() -> list[Path]:
    """Write every artifact; return the paths that changed."""
    JSON_DIR.mkdir(parents=True, exist_ok=True)
    changed = stale_files()
    expected = render()
    for path in changed:
        if path in expected:
            path.write_text(expected[path], encoding="utf-8")
        else:
            path.unlink()
    return changed


def main(argv: list[str] | None = None) -> int:
    """CLI entry point: write the artifacts, or with ``--check`` report stale ones (exit 1)."""
    parser = argparse.ArgumentParser(prog="python -m llmbatch.schemas.generate", description=__doc__)
    parser.add_argument("--check", action="store_true", help="exit 1 if an artifact is stale")
    args = parser.parse_args(argv)
    if args.check:
        stale = stale_files()
        for path in stale:
            print(f"stale: {path.relative_to(PACKAGE_DIR.parent)}", file=sys.stderr)
        if stale:
            print("run `python -m llmbatch.schemas.generate` and commit the result", file=sys.stderr)
        return 1 if stale else 0
    for path in write():
        print(f"wrote {path.relative_to(PACKAGE_DIR.parent)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
