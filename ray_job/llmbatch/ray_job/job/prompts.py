"""Prompt stage: chat template / tokenization of each request, and its sampling arguments.

Chat requests are rendered with the model's own chat template (``tokenizer.apply_chat_template``,
generation prompt added) and tokenized without extra special tokens, exactly as vLLM's ``LLM.chat``
does; completion prompts are tokenized with special tokens, as ``LLM.generate`` does, and so is
each text input of an embedding request (``LLM.embed``). The engine
then receives token ids, so the prompt token count in ``usage`` is the one the engine ran.

The tokenizer is the model's own (:class:`~llmbatch.ray_job.engines.tokenizers.HFTokenizer`) unless the
engine backend is a plug-in with a tokenizer of its own (:mod:`llmbatch.ray_job.engines.backends`).
"""

from __future__ import annotations

from typing import Any

import orjson
import pyarrow as pa

from llmbatch.ray_job.engines.backends import keeps_prompt_text, make_tokenizer
from llmbatch.ray_job.engines.tokenizers import Tokenizer
from llmbatch.ray_job.errors import INVALID_PROMPT, RequestFailure
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.formatting import error_line
from llmbatch.ray_job.lines.sampling import pooling_kwargs, sampling_kwargs
from llmbatch.schemas.common import Endpoint


def chat_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """OpenAI messages -> template input: text parts joined, ``developer`` treated as ``system``."""
    out = []
    for message in body["messages"]:
        content = message["content"]
        if isinstance(content, list):
            content = "".join(part["text"] for part in content)
        role = "system" if message["role"] == "developer" else message["role"]
        item: dict[str, Any] = {"role": role, "content": content}
        if message.get("name"):
            item["name"] = message["name"]
        out.append(item)
    return out


def render_prompt(tokenizer: Tokenizer, endpoint: Endpoint, body: dict[str, Any]) -> tuple[str, list[int]]:
    """The prompt text and token ids of one request body."""
    if endpoint is Endpoint.CHAT_COMPLETIONS:
        text = tokenizer.render_chat(chat_messages(body))
        return text, tokenizer.encode(text, add_special_tokens=False)
    text = body["prompt"]
    return text, tokenizer.encode(text, add_special_tokens=True)


def embedding_inputs(tokenizer: Tokenizer, body: dict[str, Any]) -> list[list[int]]:
    """The token ids of each input of a ``/v1/embeddings`` body: texts are tokenized with special
    tokens (as vLLM's ``LLM.embed``), token lists are taken as they are."""
    value = body["input"]
    items = [value] if isinstance(value, str) or (value and isinstance(value[0], int)) else value
    return [
        tokenizer.encode(item, add_special_tokens=True) if isinstance(item, str) else list(item)
        for item in items
    ]


def _embedding_row(tokenizer: Tokenizer, row: rows.Row, body: dict[str, Any], *, keep_text: bool) -> rows.Row:
    inputs = embedding_inputs(tokenizer, body)
    prompt: dict[str, Any] = {
        "inputs": inputs,
        "sampling": {"pooling": pooling_kwargs(body)},
        "encoding_format": body.get("encoding_format") or "float",
    }
    if keep_text:
        prompt["prompt"] = body["input"] if isinstance(body["input"], str) else ""
    return rows.Row(row.line_no, rows.REQUEST, row.custom_id, orjson.dumps(prompt), sum(map(len, inputs)))


def build_rows(
    tokenizer: Tokenizer, endpoint: Endpoint, batch: list[rows.Row], *, batch_id: str, keep_text: bool
) -> list[rows.Row]:
    """Apply the prompt stage to a batch: request rows get token ids and sampling arguments."""
    out = []
    for row in batch:
        if row.kind != rows.REQUEST:
            out.append(row)
            continue
        request = orjson.loads(row.payload)
        body = request["body"]
        if endpoint.pooling:
            out.append(_embedding_row(tokenizer, row, body, keep_text=keep_text))
            continue
        try:
            text, ids = render_prompt(tokenizer, endpoint, body)
        except Exception as exc:  # a template may reject a conversation (e.g. roles out of order)
            failure = RequestFailure(
                INVALID_PROMPT, f"cannot render the prompt: {exc}"[:2000], "body.messages", 400
            )
            payload = error_line(failure, batch_id=batch_id, custom_id=row.custom_id, line_no=row.line_no)
            out.append(rows.Row(row.line_no, rows.ERROR, row.custom_id, payload))
            continue
        prompt: dict[str, Any] = {"prompt_token_ids": ids, "sampling": sampling_kwargs(endpoint, body)}
        if keep_text:
            prompt["prompt"] = text
        out.append(rows.Row(row.line_no, rows.REQUEST, row.custom_id, orjson.dumps(prompt), len(ids)))
    return out


class PromptStage:
    """Ray Data callable class (actor pool): renders and tokenizes request rows."""

    def __init__(self, *, model_path: str, endpoint: str, batch_id: str, backend: str) -> None:
        self._tokenizer = make_tokenizer(backend, model_path)
        self._keep_text = keeps_prompt_text(backend)
        self._endpoint = Endpoint(endpoint)
        self._batch_id = batch_id

    def __call__(self, batch: pa.Table) -> pa.Table:
        out = build_rows(
            self._tokenizer,
            self._endpoint,
            rows.from_table(batch),
            batch_id=self._batch_id,
            keep_text=self._keep_text,
        )
        return rows.to_table(out)
