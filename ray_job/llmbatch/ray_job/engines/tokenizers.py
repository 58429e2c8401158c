"""The tokenizer the prompt stage renders and tokenizes requests with."""

from __future__ import annotations

from typing import Any, Protocol


class Tokenizer(Protocol):
    """What the prompt stage needs from a tokenizer."""

    def render_chat(self, messages: list[dict[str, Any]]) -> str: ...

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]: ...


def preload() -> None:
    """Import what :class:`HFTokenizer` loads with, ahead of the first tokenizer: importing
    ``transformers``' ``AutoTokenizer`` took 6.4 s of a process on a 2-core CPU node, loading a tokenizer
    then 0.7 s. Does nothing where transformers is not installed (a plug-in's own tokenizer)."""
    try:
        from transformers import AutoTokenizer  # noqa: F401
    except ImportError:
        return


class HFTokenizer:
    """The model's Hugging Face tokenizer (loaded from the model folder or the local HF cache)."""

    def __init__(self, model_path: str) -> None:
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(model_path)

    def render_chat(self, messages: list[dict[str, Any]]) -> str:
        text = self._tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return str(text)

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens))
