"""Engine backends: vLLM, or a plug-in class named by its import path (``engine.backend``).

A plug-in is a class importable where the engines run (the Ray workers' environment), with:

- ``__init__(self, model_path: str, config: EngineConfig)``; its own options come in
  ``config.backend_options``, which it validates;
- the members of :class:`~llmbatch.ray_job.engines.engine_runner.Backend` (``add``, ``abort``,
  ``has_unfinished``, ``step``, ``max_model_len``, ``default_max_tokens``);
- optionally a class method ``tokenizer(model_path) -> Tokenizer`` (what renders and tokenizes its
  prompts when that is not the model's own Hugging Face tokenizer) and a class attribute
  ``keeps_prompt_text`` (True when it needs the rendered prompt's text besides its token ids).

:class:`llmbatch.ray_job.engines.backend_fake.FakeBackend` is one, for tests of everything around the engine
(as httpx's ``MockTransport`` is for HTTP clients): ``engine.backend =``
:data:`FAKE_BACKEND`. Nothing in the job spec or the settings names it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from llmbatch.ray_job.engines.tokenizers import HFTokenizer, Tokenizer
from llmbatch.ray_job.errors import InvalidSpecError
from llmbatch.schemas.job import VLLM_BACKEND, EngineConfig

if TYPE_CHECKING:
    from llmbatch.ray_job.engines.engine_runner import Backend

FAKE_BACKEND = "llmbatch.ray_job.engines.backend_fake:FakeBackend"
"""The import path of the deterministic stand-in engine for tests."""

_REQUIRED = ("add", "abort", "has_unfinished", "step")


def backend_class(ref: str) -> type[Any] | None:
    """The plug-in class ``ref`` (``package.module:Class``) names; None for vLLM.
    :class:`InvalidSpecError` (naming ``engine.backend``) when it cannot be imported or is not a
    backend class."""
    if ref == VLLM_BACKEND:
        return None
    module_name, _, attr = ref.partition(":")
    try:
        found = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise InvalidSpecError(
            f"engine.backend {ref!r}: cannot import it here ({type(exc).__name__}: {exc}); install "
            "the plug-in where the engines run, or use 'vllm'"
        ) from None
    missing = [name for name in _REQUIRED if not callable(getattr(found, name, None))]
    if not isinstance(found, type) or missing:
        raise InvalidSpecError(
            f"engine.backend {ref!r} is not an engine backend class (missing: "
            f"{', '.join(missing) or 'a class'}); see llmbatch.ray_job.engines.backends"
        )
    return found


def make_backend(model_path: str, config: EngineConfig) -> Backend:
    """The engine ``config.backend`` names, started for ``model_path``."""
    plugin = backend_class(config.backend)
    if plugin is None:
        from llmbatch.ray_job.engines.backend_vllm import VllmBackend

        return VllmBackend(model_path, config)
    backend: Backend = plugin(model_path, config)
    return backend


def make_tokenizer(ref: str, model_path: str) -> Tokenizer:
    """What renders and tokenizes prompts for backend ``ref``: the plug-in's own when it has one,
    else the model's Hugging Face tokenizer."""
    plugin = backend_class(ref)
    own = getattr(plugin, "tokenizer", None)
    if own is not None:
        tokenizer: Tokenizer = own(model_path)
        return tokenizer
    return HFTokenizer(model_path)


def keeps_prompt_text(ref: str) -> bool:
    """True when backend ``ref`` needs the rendered prompt's text besides its token ids."""
    return bool(getattr(backend_class(ref), "keeps_prompt_text", False))
