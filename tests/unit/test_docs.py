"""The settings table of docs/configuration.md is generated from the settings models and must be current."""

from __future__ import annotations

from pathlib import Path

import pytest

from llmbatch import docs

pytestmark = pytest.mark.unit


def _leaf_count() -> int:
    from pydantic import BaseModel

    from llmbatch.dispatcher.settings import DispatcherSettings

    def count(model: type[BaseModel]) -> int:
        total = 0
        for info in model.model_fields.values():
            ann = info.annotation
            total += count(ann) if isinstance(ann, type) and issubclass(ann, BaseModel) else 1
        return total

    from llmbatch.api.settings import ApiOptions

    return count(DispatcherSettings) + count(ApiOptions)  # the HTTP API's section too


def test_table_has_one_row_per_setting_with_env_var_and_default() -> None:
    table = docs.settings_table()
    rows = [line for line in table.splitlines() if line.startswith("| `LLMBATCH_")]
    assert len(rows) == _leaf_count()
    assert len({r.split("|")[1] for r in rows}) == len(rows)  # no duplicates
    assert "| `LLMBATCH_KAFKA__TOPICS__DEAD_LETTER` | string | `llm.batch.requests.v1.dlt` |" in table
    assert "| `LLMBATCH_ENGINES__MODELS` | JSON object | `{}` |" in table  # the model registry
    assert "LLMBATCH_JOB__MODEL_PATH" not in table and "LLMBATCH_JOB__ENGINE__" not in table
    # the fields of one registry entry (a JSON value, not variables of their own)
    assert "| `path` | string | *required* |" in table
    assert "| `engine.enforce_eager` | boolean | `false` |" in table
    assert "| `scaling.min_replicas` | integer | `0` |" in table
    assert "| `LLMBATCH_S3__SECRET_KEY` | secret | *(empty)* |" in table  # secrets never shown
    assert "| `LLMBATCH_API__KEYS` | JSON object | `{}` |" in table  # the HTTP API's


def test_configuration_table_is_current() -> None:
    text = docs.README.read_text(encoding="utf-8")
    block = docs.current_block(text)
    assert docs.README.name == "configuration.md" and docs.README.parent.name == "docs"
    assert block is not None, "docs/configuration.md lost its settings-table markers"
    assert block == docs.settings_table(), (
        "docs/configuration.md settings table is stale: run `python -m llmbatch.docs settings-table --write`"
    )


def test_check_and_write_round_trip(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n{docs.START_MARKER}\n| old |\n{docs.END_MARKER}\n\nafter\n", encoding="utf-8")
    assert docs.main(["settings-table", "--check", "--readme", str(readme)]) == 1
    assert docs.main(["settings-table", "--write", "--readme", str(readme)]) == 0
    assert docs.main(["settings-table", "--check", "--readme", str(readme)]) == 0
    text = readme.read_text(encoding="utf-8")
    assert text.startswith("# x\n") and text.endswith(f"{docs.END_MARKER}\n\nafter\n")
    assert "| old |" not in text
