"""A fast deterministic engine for tests of everything around the engine (never proof of vLLM).

A plug-in backend (:mod:`llmbatch.ray_job.engines.backends`): ``engine.backend =
"llmbatch.ray_job.engines.backend_fake:FakeBackend"``, with options (``engine.backend_options``, see
:class:`FakeOptions`). It answers ``"fake reply to: <last words of the prompt>"`` cut to
``max_tokens`` words, counts tokens by whitespace (:class:`WhitespaceTokenizer`, no model files),
finishes each request ``delay_s`` after it was added (requests overlap, like continuous batching),
and fails the requests whose custom_id is in ``fail_custom_ids`` with an engine error, through the
same per-request isolation path as vLLM.
"""

from __future__ import annotations

import math
import struct
import time
import zlib
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from llmbatch.ray_job.errors import InvalidSpecError
from llmbatch.ray_job.lines.records import Generation, GenRequest, TokenLogprob
from llmbatch.schemas.errors import LLMBatchError
from llmbatch.schemas.job import EngineConfig

DEFAULT_MAX_MODEL_LEN = 2048


class WhitespaceTokenizer:
    """Deterministic stand-in for tests: one token per whitespace-separated word."""

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        lines = [f"<{m['role']}> {m['content']}" for m in messages]
        return "\n".join([*lines, "<assistant>"])

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return [zlib.crc32(word.encode()) % 50_000 for word in text.split()]


class FakeEngineError(LLMBatchError, RuntimeError):
    """The simulated per-request engine failure."""


class FakeOptions(BaseModel):
    """The fake's ``engine.backend_options``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    delay_s: float = Field(default=0.0, ge=0, le=60, description="Seconds per request.")
    fail_custom_ids: list[str] = Field(
        default_factory=list, description="Requests that fail with an engine error."
    )


class FakeBackend:
    """Same interface as :class:`llmbatch.ray_job.engines.backend_vllm.VllmBackend`."""

    default_max_tokens: int | None = None
    keeps_prompt_text = True  # it answers from the prompt's words

    def __init__(self, model_path: str, config: EngineConfig) -> None:
        try:
            options = FakeOptions.model_validate(config.backend_options)
        except ValidationError as exc:
            raise InvalidSpecError(f"engine.backend_options of the fake backend: {exc}") from None
        self.max_model_len = config.max_model_len or DEFAULT_MAX_MODEL_LEN
        self._delay = options.delay_s
        self._fail = frozenset(options.fail_custom_ids)
        self._pending: list[tuple[float, GenRequest]] = []

    @classmethod
    def tokenizer(cls, model_path: str) -> WhitespaceTokenizer:
        """No model files: one token per word."""
        return WhitespaceTokenizer()

    def add(self, request: GenRequest) -> None:
        if request.custom_id in self._fail:
            raise FakeEngineError(f"simulated engine failure for {request.custom_id!r}")
        self._pending.append((time.monotonic() + self._delay, request))

    def abort(self, keys: list[str]) -> None:
        drop = set(keys)
        self._pending = [(due, req) for due, req in self._pending if req.key not in drop]

    def has_unfinished(self) -> bool:
        return bool(self._pending)

    def step(self) -> list[Generation]:
        if not self._pending:
            return []
        now = time.monotonic()
        first_due = min(due for due, _ in self._pending)
        if first_due > now:
            time.sleep(min(first_due - now, 0.05))
            now = time.monotonic()
        done = [req for due, req in self._pending if due <= now]
        self._pending = [(due, req) for due, req in self._pending if due > now]
        return [fake_generation(req) for req in done]


FAKE_EMBEDDING_DIMENSIONS = 8


def fake_embedding(token_ids: list[int], dimensions: int = FAKE_EMBEDDING_DIMENSIONS) -> list[float]:
    """A deterministic unit vector derived from the token ids (equal inputs, equal vectors)."""
    seed = zlib.crc32(struct.pack(f"<{len(token_ids)}q", *token_ids))
    raw = [((seed * (i + 1) * 2654435761) % 2001 - 1000) / 1000 + 1e-3 for i in range(dimensions)]
    norm = math.sqrt(sum(x * x for x in raw))
    return [x / norm for x in raw]


def fake_generation(request: GenRequest) -> Generation:
    """The deterministic answer to one request."""
    if "pooling" in request.sampling:
        dims = int(request.sampling["pooling"].get("dimensions") or FAKE_EMBEDDING_DIMENSIONS)
        return Generation(
            request.key,
            prompt_tokens=len(request.prompt_token_ids),
            embedding=fake_embedding(request.prompt_token_ids, dims),
        )
    words = [w for w in request.prompt_text.split() if not (w.startswith("<") and w.endswith(">"))]
    reply = ["fake", "reply", "to:", *words[-6:]]
    limit = int(request.sampling.get("max_tokens") or len(reply))
    finish = "length" if len(reply) > limit else "stop"
    reply = reply[:limit]
    logprobs = None
    if request.sampling.get("logprobs") is not None:
        top_k = int(request.sampling["logprobs"])
        logprobs = [TokenLogprob(w, -0.5, [(w, -0.5)] if top_k else []) for w in reply]
    return Generation(
        request.key,
        text=" ".join(reply),
        finish_reason=finish,
        prompt_tokens=len(request.prompt_token_ids),
        completion_tokens=len(reply),
        logprobs=logprobs,
    )
