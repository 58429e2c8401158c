"""What `make demo` prints and returns once a batch ended: answers, error lines, counts and timings.

The results come from a small in-memory stand-in for the producer SDK (the real one reads MinIO;
tests/e2e/test_demo.py runs the whole demo on it); the event, lines and manifest are the real schemas.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from llmbatch.adapters.errors import ResultsNotFound
from llmbatch.demo import report as demo_report
from llmbatch.demo.batch import Batch
from llmbatch.schemas import Envelope
from llmbatch.schemas.events import BatchCompleted, BatchFailed
from llmbatch.schemas.job import Manifest, Timings
from llmbatch.schemas.openai import BatchOutputLine, ErrorObject, RequestCounts, ResponseObject, Usage

pytestmark = pytest.mark.unit
T0 = datetime(2026, 11, 29, 6, 0, tzinfo=UTC)


def _answer(custom_id: str, body: dict[str, Any]) -> BatchOutputLine:
    return BatchOutputLine(
        id=f"r-{custom_id}",
        custom_id=custom_id,
        response=ResponseObject(status_code=200, request_id="q", body=body),
    )


class Results:
    """The producer SDK's result readers, over lines held in memory."""

    def __init__(
        self, outputs: list[BatchOutputLine], errors: list[BatchOutputLine], manifest: Manifest | None
    ) -> None:
        self.outputs, self.errors, self.manifest_doc = outputs, errors, manifest

    async def iter_results(self, source: Any, *, errors: bool = False) -> AsyncIterator[BatchOutputLine]:
        for line in self.errors if errors else self.outputs:
            yield line

    async def manifest(self, batch_id: str, *, tenant: str = "default") -> Manifest:
        if self.manifest_doc is None:
            raise ResultsNotFound(f"no manifest for {batch_id}")
        return self.manifest_doc


def _completed() -> Envelope[BatchCompleted]:
    return Envelope.new(
        BatchCompleted(
            batch_id="demo-1",
            model="m",
            tenant="demo",
            accepted_at=T0,
            started_at=T0 + timedelta(seconds=2),
            finished_at=T0 + timedelta(seconds=12),
            attempts=1,
            ray_submission_id="run-1",
            output_uris=["s3://results/demo/demo-1/output-00000.jsonl"],
            request_counts=RequestCounts(total=3, completed=2, failed=1),
            usage=Usage(prompt_tokens=30, completion_tokens=40, total_tokens=70),
        ),
        source="urn:test",
    )


async def test_report_collects_answers_errors_and_timings(tmp_path: Path) -> None:
    batch = Batch(tmp_path / "b.jsonl", {"a": "capital?", "b": "haiku?"}, ["line 3: not JSON"])
    outputs = [
        _answer("a", {"choices": [{"message": {"content": "  Paris \n"}}]}),
        _answer("b", {"unexpected": True}),
    ]  # no choices: shown as its JSON, cut
    errors = [BatchOutputLine(id="r-c", custom_id="c", error=ErrorObject(code="invalid_json", message="x"))]
    timings = Timings(started_at=T0, finished_at=T0, engine_start_s=1.234, generation_s=8.0)
    manifest = Manifest(batch_id="demo-1", attempt=1, status="completed", timings=timings)
    summary = await demo_report.report(Results(outputs, errors, manifest), batch, _completed())
    assert summary["answers"] == {"a": "Paris", "b": '{"unexpected":true}'}
    assert summary["errors"] == {"c": {"code": "invalid_json", "message": "x"}}
    assert summary["timings"] == {
        "queue_wait_s": 2.0,
        "engine_start_s": 1.23,
        "generation_s": 8.0,
        "generation_tok_per_s": 5.0,
        "accepted_to_finished_s": 12.0,
    }
    assert summary["status"] == "completed" and summary["invalid_lines"] == ["line 3: not JSON"]
    assert summary["request_counts"]["failed"] == 1


async def test_report_without_manifest_or_start_still_reports(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    error = ErrorObject(code="input_invalid", message="\nevery line invalid\nmore")
    failed = Envelope.new(
        BatchFailed(
            batch_id="demo-2", model="m", accepted_at=T0, finished_at=T0 + timedelta(seconds=1), error=error
        ),
        source="urn:test",
    )
    summary = await demo_report.report(Results([], [], None), Batch(tmp_path, {}), failed, show=False)
    assert summary["timings"] == {
        "queue_wait_s": None,
        "engine_start_s": None,
        "generation_s": None,
        "generation_tok_per_s": None,
        "accepted_to_finished_s": 1.0,
    }
    printed = capsys.readouterr().out
    assert "input_invalid" in printed and "every line invalid" in printed and "more" not in printed


def test_compare_prints_both_runs(capsys: pytest.CaptureFixture[str]) -> None:
    cold = {
        "status": "completed",
        "timings": {"accepted_to_finished_s": 61.04, "engine_start_s": 40.0, "generation_s": 9.5},
    }
    warm = {
        "status": "completed",
        "timings": {"accepted_to_finished_s": 10.26, "engine_start_s": None, "generation_s": 9.1},
    }
    demo_report.compare(cold, warm)
    printed = capsys.readouterr().out
    assert "61.0 s" in printed and "10.3 s" in printed and "40.0 s" in printed and "-" in printed
