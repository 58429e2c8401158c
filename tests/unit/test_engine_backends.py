"""Engine backends are plug-ins named by import path (``engine.backend``): the stand-in engine of the
tests is one, and nothing of it is in the published job spec or the settings."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from llmbatch.ray_job.engines.backend_fake import FakeBackend, WhitespaceTokenizer
from llmbatch.ray_job.engines.backends import (
    FAKE_BACKEND,
    backend_class,
    keeps_prompt_text,
    make_backend,
    make_tokenizer,
)
from llmbatch.ray_job.errors import InvalidSpecError
from llmbatch.schemas.generate import JSON_DIR
from llmbatch.schemas.job import EngineConfig

pytestmark = pytest.mark.unit


def test_the_published_job_spec_knows_no_fake_engine() -> None:
    schema = (JSON_DIR / "job-spec.schema.json").read_text()
    assert "fake" not in schema.lower()
    engine = json.loads(schema)["$defs"]["EngineConfig"]["properties"]
    assert "backend_options" in engine and engine["backend"]["default"] == "vllm"


def test_the_fake_plugs_in_by_its_import_path_with_its_own_options() -> None:
    config = EngineConfig(backend=FAKE_BACKEND, backend_options={"delay_s": 0.5, "fail_custom_ids": ["x"]})
    assert backend_class(config.backend) is FakeBackend
    backend = make_backend("unused", config)
    assert isinstance(backend, FakeBackend)
    assert isinstance(make_tokenizer(config.backend, "unused"), WhitespaceTokenizer)
    assert keeps_prompt_text(config.backend) is True


def test_vllm_takes_the_models_tokenizer_and_no_plugin_options() -> None:
    assert backend_class("vllm") is None and keeps_prompt_text("vllm") is False
    with pytest.raises(ValidationError, match=r"engine\.backend_options"):
        EngineConfig(backend="vllm", backend_options={"delay_s": 1})


def test_the_fakes_options_are_checked_with_the_field_named() -> None:
    config = EngineConfig(backend=FAKE_BACKEND, backend_options={"dealy_s": 1})
    with pytest.raises(InvalidSpecError, match=r"(?s)backend_options of the fake backend.*dealy_s"):
        make_backend("unused", config)


@pytest.mark.parametrize(
    "ref",
    ["fake", "vllm\n", f"{FAKE_BACKEND}\n", "os:system()", "a.b", ":Cls", "a..b:C", "vllm "],
)
def test_a_backend_that_is_not_vllm_or_a_whole_import_path_is_refused(ref: str) -> None:
    with pytest.raises(ValidationError, match=r"engine\.backend: use 'vllm' or the import path"):
        EngineConfig(backend=ref)


@pytest.mark.parametrize(
    ("ref", "says"),
    [
        ("no_such_module_here:Backend", "cannot import it here"),
        ("llmbatch.ray_job.engines.backends:NoSuchClass", "cannot import it here"),
        ("llmbatch.ray_job.engines.backends:FAKE_BACKEND", "is not an engine backend class"),
        ("llmbatch.ray_job.engines.tokenizers:HFTokenizer", "missing: add, abort, has_unfinished, step"),
    ],
)
def test_a_plugin_that_cannot_be_used_is_the_specs_fault(ref: str, says: str) -> None:
    with pytest.raises(InvalidSpecError, match=says) as raised:
        backend_class(ref)
    assert raised.value.code == "invalid_job_spec" and "engine.backend" in str(raised.value)


class PlainBackend:
    """A plug-in with no tokenizer of its own (only what a backend must have)."""

    def add(self) -> None: ...
    def abort(self) -> None: ...
    def has_unfinished(self) -> None: ...
    def step(self) -> None: ...


def test_a_plugin_without_a_tokenizer_of_its_own_gets_the_models(tmp_path: Path) -> None:
    ref = f"{__name__}:PlainBackend"
    assert backend_class(ref) is PlainBackend and keeps_prompt_text(ref) is False
    # Hugging Face's loader looked for the model's tokenizer files in the (empty) folder
    with pytest.raises(ValueError, match="instantiate the backend tokenizer"):
        make_tokenizer(ref, str(tmp_path))
