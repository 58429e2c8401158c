"""ray_job.job.outcome: how an attempt ends (pure), and the result line the dispatcher reads back."""

from __future__ import annotations

import pytest

from llmbatch.ray_job.job import manifest
from llmbatch.ray_job.job.outcome import (
    SUPERSEDED,
    attempt_result,
    emit_result,
    failure_result,
    settle,
    stop_error,
)
from llmbatch.ray_job.job.submit import parse_result
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.job import JobSpec, ShardInfo
from llmbatch.schemas.openai import ErrorObject, Usage

pytestmark = pytest.mark.unit
LINES = {"output_lines": 3, "error_lines": 1, "invalid_lines": 1}


def test_a_complete_attempt_with_some_valid_lines_stays_completed() -> None:
    assert settle("completed", None, intact=True, resumed=False, **LINES) == ("completed", None)


def test_shards_not_all_written_make_a_completed_attempt_partial() -> None:
    assert settle("completed", None, intact=False, resumed=False, **LINES) == ("partial", None)


@pytest.mark.parametrize(("errors", "says"), [(4, "none of the 4 input lines"), (0, "empty file")])
def test_no_valid_line_at_all_fails_the_batch_with_input_invalid(errors: int, says: str) -> None:
    status, error = settle(
        "completed",
        None,
        intact=True,
        resumed=False,
        output_lines=0,
        error_lines=errors,
        invalid_lines=errors,
    )
    assert status == "failed" and error is not None
    assert error.code == "input_invalid" and says in error.message


def test_engine_errors_or_earlier_shards_are_not_invalid_input() -> None:
    # every line failed on the engine (errors beyond the invalid ones): the batch completed
    assert (
        settle("completed", None, intact=True, resumed=False, output_lines=0, error_lines=3, invalid_lines=1)[
            0
        ]
        == "completed"
    )
    # a resumed attempt with nothing left to do: its earlier attempts wrote the answers
    assert (
        settle("completed", None, intact=True, resumed=True, output_lines=0, error_lines=0, invalid_lines=0)[
            0
        ]
        == "completed"
    )


def test_a_stopped_attempt_keeps_its_status_and_error() -> None:
    stopped = stop_error("deadline")
    assert settle(
        "partial", stopped, intact=True, resumed=False, output_lines=0, error_lines=0, invalid_lines=0
    ) == ("partial", stopped)


def test_stop_errors_name_the_reason() -> None:
    assert stop_error("deadline").code == "deadline_exceeded"
    assert stop_error("SIGTERM") == ErrorObject(
        code="stopped", message="the attempt was stopped early (SIGTERM)"
    )
    assert stop_error(SUPERSEDED).code == "superseded"


def test_the_result_line_reads_back_through_the_dispatchers_parser(
    capsys: pytest.CaptureFixture[str],
) -> None:
    emit_result(failure_result(None, 3, "input_not_found", "x" * 5000))
    printed = capsys.readouterr().out
    result = parse_result("INFO some log line\n" + printed)
    assert result is not None and result["status"] == "failed" and result["exit_code"] == 3
    assert result["batch_id"] is None and len(result["error"]["message"]) == 4000


def test_the_result_line_of_an_attempt_that_ran_carries_its_manifests_figures(
    capsys: pytest.CaptureFixture[str],
) -> None:
    spec = JobSpec.model_validate(
        {
            "batch_id": "b1",
            "attempt": 2,
            "endpoint": "/v1/chat/completions",
            "model": "m",
            "input_uri": "s3://inputs/b1.jsonl",
            "output_prefix": "s3://results/default/b1/",
        }
    )
    prefix = "s3://results/default/b1/"
    shards = [
        ShardInfo(uri=f"{prefix}output-a2-00000.jsonl", lines=5, attempt=2),
        ShardInfo(uri=f"{prefix}output-a2-00001.jsonl", lines=2, attempt=2),
        ShardInfo(uri=f"{prefix}error-a2-00000.jsonl", lines=1, attempt=2),
    ]
    error = ErrorObject(code="deadline_exceeded", message="the attempt was stopped early (deadline)")
    built = manifest.build(
        batch_id="b1",
        attempt=2,
        status="partial",
        total=10,
        shards=shards,
        usage=Usage(prompt_tokens=70, completion_tokens=30),
        attempts=[],
        started_at=utcnow(),
        finished_at=utcnow(),
        engine_start_s=1.5,
        generation_s=4.25,
        error=error,
    )
    emit_result(attempt_result(spec, built, error))
    result = parse_result(capsys.readouterr().out)
    assert result is not None
    assert (result["batch_id"], result["attempt"], result["status"]) == ("b1", 2, "partial")
    assert result["request_counts"] == {"total": 10, "completed": 7, "failed": 1}
    assert result["usage"]["prompt_tokens"] == 70 and result["usage"]["completion_tokens"] == 30
    assert (result["output_shards"], result["error_shards"]) == (2, 1)
    assert result["manifest_uri"] == spec.manifest_uri
    assert result["timings"]["engine_start_s"] == 1.5 and result["timings"]["generation_s"] == 4.25
    assert result["error"] == {"code": "deadline_exceeded", "message": error.message}
