"""Plain records passed between the pipeline stages: one request in, one generation out.

They cross Ray process boundaries as JSON inside the ``payload`` column (see
:mod:`llmbatch.ray_job.lines.rows`), so they hold only JSON-friendly values.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmbatch.ray_job.errors import RequestFailure


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """Log-probability of one generated token, with the most likely alternatives."""

    token: str
    logprob: float
    top: list[tuple[str, float]] = field(default_factory=list)


@dataclass(slots=True)
class GenRequest:
    """One request as the engine sees it: the rendered prompt and vLLM-style sampling arguments
    (or, for an embedding, ``{"pooling": {...}}``: vLLM ``PoolingParams`` arguments).

    ``key`` identifies the request inside one job attempt (the input line number as text).
    """

    key: str
    prompt_token_ids: list[int]
    sampling: dict[str, Any]
    prompt_text: str = ""
    custom_id: str = ""


@dataclass(slots=True)
class Generation:
    """The engine's answer to one :class:`GenRequest`: a completion or a per-request failure."""

    key: str
    text: str = ""
    finish_reason: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    logprobs: list[TokenLogprob] | None = None
    embedding: list[float] | None = None
    """The vector of an embedding request (``sampling`` holds ``pooling``); ``None`` for text."""
    failure: RequestFailure | None = None
