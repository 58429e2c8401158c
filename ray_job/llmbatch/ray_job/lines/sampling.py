"""Per-request sampling: OpenAI body fields -> vLLM ``SamplingParams`` keyword arguments, and the
context-window check (pure functions, no engine needed).

Semantics follow vLLM's OpenAI server: fields the request leaves out take the model's generation
defaults (``generation_config.json``), then vLLM's; a missing ``max_tokens`` means "up to the end
of the context window"; a prompt that does not fit, or ``max_tokens`` beyond what is left, is a
``context_length_exceeded`` error for that request only.
"""

from __future__ import annotations

from typing import Any

from llmbatch.ray_job.errors import CONTEXT_LENGTH_EXCEEDED, RequestFailure
from llmbatch.schemas.common import Endpoint

# OpenAI/vLLM body field -> SamplingParams argument (same name unless listed)
_PASSTHROUGH = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)


def sampling_kwargs(endpoint: Endpoint, body: dict[str, Any]) -> dict[str, Any]:
    """The ``SamplingParams`` arguments a request asks for (absent fields are left out).

    ``max_tokens`` is included only when the request sets it (``max_tokens`` or, for chat,
    ``max_completion_tokens``); ``logprobs`` is the number of alternatives per token (0 = only the
    sampled token), or absent when the request asks for no logprobs.
    """
    out: dict[str, Any] = {"n": 1}
    for name in _PASSTHROUGH:
        if body.get(name) is not None:
            out[name] = body[name]
    max_tokens = body.get("max_completion_tokens")
    if max_tokens is None:
        max_tokens = body.get("max_tokens")
    if max_tokens is not None:
        out["max_tokens"] = max_tokens
    if body.get("logit_bias"):
        out["logit_bias"] = dict(body["logit_bias"])  # token ids stay strings until the engine (JSON keys)
    stop = body.get("stop")
    if stop is not None:
        out["stop"] = [stop] if isinstance(stop, str) else list(stop)
    if endpoint is Endpoint.CHAT_COMPLETIONS:
        if body.get("logprobs"):
            out["logprobs"] = body.get("top_logprobs") or 0
        structured = structured_outputs(body.get("response_format"))
        if structured is not None:
            out["structured_outputs"] = structured
    elif body.get("logprobs") is not None:
        out["logprobs"] = body["logprobs"]
    return out


def structured_outputs(response_format: Any) -> dict[str, Any] | None:
    """vLLM ``StructuredOutputsParams`` arguments for a chat body's ``response_format`` (a plain
    dict, so it travels to the engine as JSON): ``json_object`` -> any JSON object, ``json_schema``
    -> its schema (or any object when it has none), ``text`` or absent -> ``None``."""
    if not isinstance(response_format, dict):
        return None
    kind = response_format.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (response_format.get("json_schema") or {}).get("schema")
        return {"json": schema} if schema is not None else {"json_object": True}
    return None


def pooling_kwargs(body: dict[str, Any]) -> dict[str, Any]:
    """The ``PoolingParams`` arguments of a ``/v1/embeddings`` body (``dimensions`` when asked)."""
    out: dict[str, Any] = {}
    if body.get("dimensions") is not None:
        out["dimensions"] = body["dimensions"]
    return out


MAX_EMBEDDING_TOKENS_PER_LINE = 300_000
"""Most tokens all inputs of one ``/v1/embeddings`` line may sum to (OpenAI's per-request limit); it also
bounds what one line holds in memory on its way through the stages."""


def fit_inputs(inputs: list[list[int]], max_model_len: int) -> RequestFailure | None:
    """An embedding line's inputs against the context window: each must fit whole (OpenAI refuses
    longer inputs rather than cutting them), and together at most
    :data:`MAX_EMBEDDING_TOKENS_PER_LINE` tokens."""
    total = sum(map(len, inputs))
    if total > MAX_EMBEDDING_TOKENS_PER_LINE:
        return RequestFailure(
            "max_tokens_per_request",
            f"Requested {total} tokens, max {MAX_EMBEDDING_TOKENS_PER_LINE} tokens per request: split the "
            "inputs over more lines.",
            "input",
            400,
        )
    for index, ids in enumerate(inputs):
        if len(ids) > max_model_len:
            return RequestFailure(
                CONTEXT_LENGTH_EXCEEDED,
                f"This model's maximum context length is {max_model_len} tokens. However, input {index} has "
                f"{len(ids)} tokens. Please reduce the length of the input.",
                "input",
                400,
            )
    return None


def wants_logprobs(sampling: dict[str, Any]) -> bool:
    """True when the request asked for logprobs."""
    return sampling.get("logprobs") is not None


def fit_context(
    sampling: dict[str, Any],
    prompt_tokens: int,
    max_model_len: int,
    *,
    prompt_field: str = "messages",
    default_max_tokens: int | None = None,
) -> RequestFailure | None:
    """Check the request against the context window; fill in a default ``max_tokens``.

    Returns a failure (HTTP 400 ``context_length_exceeded``) when the prompt leaves no room for
    output or ``max_tokens`` exceeds what is left; otherwise, when the request did not choose
    ``max_tokens``, sets it to the room left (capped by the model's ``default_max_tokens``), and
    returns ``None``.
    """
    room = max_model_len - prompt_tokens
    if room <= 0:
        return RequestFailure(
            CONTEXT_LENGTH_EXCEEDED,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_tokens} tokens. Please reduce the length of the messages or prompt.",
            prompt_field,
            400,
        )
    asked = sampling.get("max_tokens")
    if asked is None:
        sampling["max_tokens"] = min(room, default_max_tokens) if default_max_tokens else room
        return None
    if asked > room:
        return RequestFailure(
            CONTEXT_LENGTH_EXCEEDED,
            f"'max_tokens' is too large: {asked}. This model's maximum context length is {max_model_len} "
            f"tokens and your request has {prompt_tokens} input tokens ({asked} > {max_model_len} - "
            f"{prompt_tokens}).",
            "max_tokens",
            400,
        )
    return None
