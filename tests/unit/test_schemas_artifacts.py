"""Generated artifacts are fresh and valid; ``schemas`` imports without client libraries."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from llmbatch.schemas import (
    EVENT_DATA_MODELS,
    BatchCompleted,
    BatchRequest,
    Envelope,
    EventType,
    encode,
    generate,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_checked_in_artifacts_are_fresh() -> None:
    stale = generate.stale_files()
    assert not stale, f"stale artifacts {stale}: run `python -m llmbatch.schemas.generate`, commit the result"


def test_check_mode_exit_codes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert generate.main(["--check"]) == 0
    monkeypatch.setattr(generate, "JSON_DIR", tmp_path / "json")
    monkeypatch.setattr(generate, "ASYNCAPI_PATH", tmp_path / "asyncapi.yaml")
    monkeypatch.setattr(generate, "PACKAGE_DIR", tmp_path)
    assert generate.main(["--check"]) == 1  # nothing written yet
    assert generate.main([]) == 0
    assert generate.main(["--check"]) == 0
    (tmp_path / "json" / "manifest.schema.json").write_text("{}\n")
    (tmp_path / "json" / "leftover.schema.json").write_text("{}\n")
    assert {p.name for p in generate.stale_files()} == {"manifest.schema.json", "leftover.schema.json"}
    generate.main([])
    assert not (tmp_path / "json" / "leftover.schema.json").exists()
    assert generate.main(["--check"]) == 0


def test_one_json_schema_per_event_type_and_file_format() -> None:
    names = {p.name for p in generate.JSON_DIR.glob("*.schema.json")}
    expected = {f"{t.value}.schema.json" for t in EventType} | {
        f"{n}.schema.json" for n in generate.FILE_FORMATS
    }
    assert names == expected
    for path in generate.JSON_DIR.glob("*.schema.json"):
        schema = json.loads(path.read_text())
        jsonschema.Draft202012Validator.check_schema(schema)
        assert schema["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def _schema(name: str) -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((generate.JSON_DIR / f"{name}.schema.json").read_text())
    return loaded


def test_json_schemas_accept_what_models_emit_and_reject_what_they_reject() -> None:
    request = BatchRequest.model_validate(
        {
            "batch_id": "b-1",
            "model": "m",
            "endpoint": "/v1/completions",
            "input_uri": "s3://bkt/a.jsonl",
            "metadata": {"k": "v"},
        }
    )
    validator = jsonschema.Draft202012Validator(_schema("llmbatch.batch.requested.v1"))
    payload = json.loads(request.model_dump_json())
    assert not list(validator.iter_errors(payload))
    for bad in (
        {**payload, "priority": 10},
        {**payload, "batch_id": "-x"},
        {**payload, "typo": 1},
        {**payload, "endpoint": "/v1/moderations"},
        {**payload, "metadata": {f"k{i}": "v" for i in range(17)}},
    ):
        assert list(validator.iter_errors(bad)), bad
    completed = BatchCompleted.model_validate(
        {
            "batch_id": "b-1",
            "model": "m",
            "accepted_at": datetime(2026, 1, 1, tzinfo=UTC),
            "finished_at": datetime(2026, 1, 1, 1, tzinfo=UTC),
        }
    )
    validator = jsonschema.Draft202012Validator(_schema("llmbatch.batch.completed.v1"))
    assert not list(validator.iter_errors(json.loads(completed.model_dump_json())))
    for example in BatchRequest.model_config.get("json_schema_extra", {}).get("examples", []):  # type: ignore[union-attr]
        assert not list(
            jsonschema.Draft202012Validator(_schema("llmbatch.batch.requested.v1")).iter_errors(example)
        )


def test_asyncapi_describes_topics_messages_headers_and_keys() -> None:
    text = generate.ASYNCAPI_PATH.read_text()
    doc = yaml.safe_load(text)
    assert doc["asyncapi"] == "3.0.0"
    channels = doc["channels"]
    assert {c["address"] for c in channels.values()} == {
        "llm.batch.requests.v1",
        "llm.batch.results.v1",
        "llm.batch.requests.v1.dlt",
    }
    messages = doc["components"]["messages"]
    names = {m["name"] for m in messages.values()}
    assert {t.value for t in EventType} <= names
    for message in messages.values():
        assert message["bindings"]["kafka"]["key"]["type"] == "string"
        headers_ref = message["headers"]["$ref"].rsplit("/", 1)[-1]
        assert headers_ref in doc["components"]["schemas"]
    requested_headers = doc["components"]["schemas"]["batchRequestedHeaders"]
    assert set(requested_headers["required"]) >= {
        "ce_specversion",
        "ce_id",
        "ce_source",
        "ce_type",
        "ce_time",
        "ce_subject",
        "content-type",
    }
    assert requested_headers["properties"]["ce_type"]["const"] == "llmbatch.batch.requested.v1"
    dlt_headers = doc["components"]["schemas"]["DeadLetterHeaders"]["properties"]
    assert "kafka_dlt-original-offset" in dlt_headers
    assert "llmbatch-dlt-reason" in dlt_headers
    for ref in _refs(doc):  # every internal reference resolves
        node: Any = doc
        for part in ref.removeprefix("#/").split("/"):
            node = node[part]
    for operation in doc["operations"].values():
        assert operation["channel"]["$ref"].startswith("#/channels/")


def test_asyncapi_headers_schema_accepts_real_encoded_headers() -> None:
    doc = yaml.safe_load(generate.ASYNCAPI_PATH.read_text())
    for event_type, model in EVENT_DATA_MODELS.items():
        name = generate._MESSAGE_NAMES[event_type]
        schema = doc["components"]["schemas"][f"{name}Headers"]
        sample = _sample(model)
        _, _, headers = encode(Envelope.new(sample, source="urn:t"))
        as_text = {n: v.decode() for n, v in headers}
        assert not list(jsonschema.Draft202012Validator(schema).iter_errors(as_text)), event_type


def _sample(model: Any) -> Any:
    t = datetime(2026, 1, 1, tzinfo=UTC)
    base = {
        "batch_id": "b-1",
        "model": "m",
        "endpoint": "/v1/completions",
        "input_uri": "s3://bkt/a",
        "accepted_at": t,
        "finished_at": t,
        "expires_at": t,
        "updated_at": t,
        "rejected_at": t,
        "error": {"code": "c", "message": "m"},
    }
    fields = set(model.model_fields)
    return model.model_validate({k: v for k, v in base.items() if k in fields})


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def test_schemas_imports_with_only_pydantic_orjson_and_stdlib() -> None:
    script = textwrap.dedent(
        """
        import sys
        BLOCKED = {"aiokafka", "redis", "minio", "ray", "kafka", "yaml", "typer", "rich", "urllib3",
                   "pyarrow"}

        class Blocker:
            def find_spec(self, name, path=None, target=None):
                # of llmbatch, only the contracts (and the namespace itself)
                parts = name.split(".")
                above = parts[0] == "llmbatch" and len(parts) > 1 and parts[1] != "schemas"
                if parts[0] in BLOCKED or above:
                    raise ImportError(f"llmbatch.schemas must not import {name}")
                return None

        sys.meta_path.insert(0, Blocker())
        import llmbatch.schemas, llmbatch.schemas.cloudevents, llmbatch.schemas.job, llmbatch.schemas.dlt
        import llmbatch.schemas.openai, llmbatch.schemas.events
        allowed = {"llmbatch", "pydantic", "pydantic_core", "orjson", "typing_extensions", "annotated_types",
                   "typing_inspection", "_distutils_hack", "sitecustomize", "usercustomize"}
        third_party = {m.split(".")[0] for m in sys.modules} - set(sys.stdlib_module_names) - allowed
        third_party = {m for m in third_party if not m.startswith("_")}
        print(sorted(third_party))
        assert not third_party, third_party
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr + result.stdout
