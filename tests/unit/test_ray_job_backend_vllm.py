"""Which refusals of vLLM's are the request's structured outputs (``invalid_response_format``)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from llmbatch.ray_job.engines.backend_vllm import is_structured_outputs_error, llm_kwargs
from llmbatch.schemas.job import EngineConfig

pytestmark = pytest.mark.unit


def _nested(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def test_a_schema_vllm_refuses_in_its_structured_outputs_check_is_the_lines_response_format() -> None:
    from vllm.config import StructuredOutputsConfig
    from vllm.sampling_params import (
        MAX_STRUCTURED_OUTPUT_JSON_NESTING,
        SamplingParams,
        StructuredOutputsParams,
    )

    params = SamplingParams(
        structured_outputs=StructuredOutputsParams(json=_nested(MAX_STRUCTURED_OUTPUT_JSON_NESTING + 1))
    )
    with pytest.raises(Exception, match="nested too deeply") as caught:  # vLLM's own check
        params._validate_structured_outputs(
            cast(Any, SimpleNamespace(is_diffusion=False)),
            StructuredOutputsConfig(backend="xgrammar"),
            cast(Any, object()),
        )
    assert is_structured_outputs_error(caught.value)


def test_other_refusals_are_not_even_when_they_mention_json_or_a_schema() -> None:
    from vllm import SamplingParams

    with pytest.raises(Exception, match="n must be") as caught:
        SamplingParams(n=0)
    assert not is_structured_outputs_error(caught.value)

    def parse_body() -> None:
        raise ValueError("invalid JSON in the schema field of a grammar")  # what the old check matched

    with pytest.raises(ValueError, match="invalid JSON") as other:
        parse_body()
    assert not is_structured_outputs_error(other.value)
    assert not is_structured_outputs_error(ValueError("never raised"))


def test_engine_kwargs_win_over_the_named_settings() -> None:
    config = EngineConfig(max_model_len=512, max_num_seqs=4, engine_kwargs={"max_num_seqs": 8})
    kwargs = llm_kwargs("/models/m", config)
    assert kwargs["model"] == "/models/m" and kwargs["max_model_len"] == 512 and kwargs["max_num_seqs"] == 8
