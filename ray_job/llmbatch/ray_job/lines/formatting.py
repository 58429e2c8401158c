"""OpenAI batch output lines: ``{id, custom_id, response{status_code, request_id, body}, error}``.

Successful requests get a ``ChatCompletion`` (``/v1/chat/completions``), ``Completion``
(``/v1/completions``) or ``CreateEmbeddingResponse`` (``/v1/embeddings``) body with ``usage``.
Failed ones get an error line: ``error{code, message, param, line}`` always, plus an OpenAI-style
error ``response`` (HTTP 400/500, ``body.error``) when the line was a readable request. Ids are
derived from ``batch_id`` and ``custom_id``, so a request re-run in a later attempt keeps the same ids.
"""

from __future__ import annotations

import base64
import hashlib
import struct
from typing import Any

import orjson

from llmbatch.ray_job.errors import RequestFailure
from llmbatch.ray_job.lines.records import Generation, TokenLogprob
from llmbatch.schemas.common import Endpoint


def stable_hex(batch_id: str, custom_id: str, line_no: int) -> str:
    """24 hex chars identifying one input line of one batch (the same in every attempt)."""
    return hashlib.sha256(f"{batch_id}\x00{line_no}\x00{custom_id}".encode()).hexdigest()[:24]


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _token_bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="replace"))


def chat_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[0].logprobs`` of a ChatCompletion."""
    return {
        "content": [
            {
                "token": lp.token,
                "logprob": lp.logprob,
                "bytes": _token_bytes(lp.token),
                "top_logprobs": [
                    {"token": tok, "logprob": val, "bytes": _token_bytes(tok)} for tok, val in lp.top
                ],
            }
            for lp in logprobs
        ],
        "refusal": None,
    }


def completion_logprobs(logprobs: list[TokenLogprob]) -> dict[str, Any]:
    """``choices[0].logprobs`` of a (legacy) Completion."""
    offsets, offset = [], 0
    for lp in logprobs:
        offsets.append(offset)
        offset += len(lp.token)
    return {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [dict(lp.top) for lp in logprobs],
        "text_offset": offsets,
    }


def response_body(
    endpoint: Endpoint, gen: Generation, *, model: str, ident: str, created: int
) -> dict[str, Any]:
    """The ChatCompletion / Completion object for one successful generation."""
    usage = _usage(gen.prompt_tokens, gen.completion_tokens)
    if endpoint is Endpoint.CHAT_COMPLETIONS:
        return {
            "id": f"chatcmpl-{ident}",
            "object": "chat.completion",
            "created": created,
            "model": model,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": gen.text, "refusal": None},
                    "logprobs": chat_logprobs(gen.logprobs) if gen.logprobs is not None else None,
                    "finish_reason": gen.finish_reason or "stop",
                }
            ],
            "usage": usage,
            "system_fingerprint": None,
        }
    return {
        "id": f"cmpl-{ident}",
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": [
            {
                "index": 0,
                "text": gen.text,
                "logprobs": completion_logprobs(gen.logprobs) if gen.logprobs is not None else None,
                "finish_reason": gen.finish_reason or "stop",
            }
        ],
        "usage": usage,
    }


def output_line(
    endpoint: Endpoint,
    gen: Generation,
    *,
    batch_id: str,
    custom_id: str,
    line_no: int,
    model: str,
    created: int,
) -> bytes:
    """One output-file line (JSON + newline) for a successful generation."""
    ident = stable_hex(batch_id, custom_id, line_no)
    return _ok_line(ident, custom_id, response_body(endpoint, gen, model=model, ident=ident, created=created))


def _ok_line(ident: str, custom_id: str, body: dict[str, Any]) -> bytes:
    line = {
        "id": f"batch_req_{ident}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": f"req_{ident}", "body": body},
        "error": None,
    }
    return orjson.dumps(line) + b"\n"


def encode_embedding(vector: list[float], encoding_format: str) -> list[float] | str:
    """One vector as OpenAI returns it: a list of floats, or (``base64``) its little-endian float32
    bytes in base64."""
    if encoding_format == "base64":
        return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
    return vector


def embedding_body(gens: list[Generation], *, model: str, encoding_format: str) -> dict[str, Any]:
    """The ``CreateEmbeddingResponse`` of one embedding line: one ``data`` item per input, in order."""
    prompt_tokens = sum(gen.prompt_tokens for gen in gens)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": index,
                "embedding": encode_embedding(gen.embedding or [], encoding_format),
            }
            for index, gen in enumerate(gens)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }


def embedding_output_line(
    gens: list[Generation],
    *,
    batch_id: str,
    custom_id: str,
    line_no: int,
    model: str,
    encoding_format: str,
) -> bytes:
    """One output-file line (JSON + newline) for an embedding line whose every input succeeded."""
    ident = stable_hex(batch_id, custom_id, line_no)
    return _ok_line(ident, custom_id, embedding_body(gens, model=model, encoding_format=encoding_format))


def error_line(failure: RequestFailure, *, batch_id: str, custom_id: str, line_no: int) -> bytes:
    """One error-file line (JSON + newline)."""
    ident = stable_hex(batch_id, custom_id, line_no)
    error = {"code": failure.code, "message": failure.message, "param": failure.param, "line": line_no}
    response = None
    if failure.status_code is not None:
        kind = "invalid_request_error" if failure.status_code < 500 else "server_error"
        response = {
            "status_code": failure.status_code,
            "request_id": f"req_{ident}",
            "body": {
                "error": {
                    "message": failure.message,
                    "type": kind,
                    "param": failure.param,
                    "code": failure.code,
                }
            },
        }
    line = {"id": f"batch_req_{ident}", "custom_id": custom_id, "response": response, "error": error}
    return orjson.dumps(line) + b"\n"
