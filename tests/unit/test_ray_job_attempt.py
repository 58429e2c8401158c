"""How one attempt ends when it is stopped or fails (ray_job.job.main.Attempt), on a local filesystem."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson
import pytest
from pyarrow import fs as pafs

from llmbatch.ray_job.errors import ExitCode
from llmbatch.ray_job.job import main as job_main
from llmbatch.ray_job.job.outcome import RESULT_PREFIX
from llmbatch.ray_job.storage import s3 as job_s3
from llmbatch.schemas.common import utcnow
from llmbatch.schemas.job import JobSpec

pytestmark = pytest.mark.unit


def _spec() -> JobSpec:
    return JobSpec.model_validate(
        {
            "batch_id": "b1",
            "attempt": 1,
            "endpoint": "/v1/chat/completions",
            "model": "m",
            "requests": [
                {
                    "custom_id": "x",
                    "method": "POST",
                    "url": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": "hi"}]},
                }
            ],
            "output_prefix": "s3://results/default/b1/",
        }
    )


@pytest.fixture
def attempt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> Any:
    (tmp_path / "results").mkdir()
    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    monkeypatch.setattr(job_s3, "filesystem", lambda session=None: local)

    def run(pipeline: Any) -> tuple[int, dict[str, Any]]:
        att = job_main.Attempt(_spec(), utcnow())
        monkeypatch.setattr(att, "_run_pipeline", lambda _input: pipeline(att))
        monkeypatch.setattr(att, "_install_stop", lambda: None)
        code = att.run()
        line = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith(RESULT_PREFIX)]
        return code, orjson.loads(line[-1][len(RESULT_PREFIX) :])

    return run


def test_a_deadline_surfacing_as_a_library_error_still_ends_as_deadline_exceeded(attempt: Any) -> None:
    def pipeline(att: job_main.Attempt) -> None:
        att.stop_reason = "deadline"  # the deadline's SIGTERM landed inside Ray Data's executor,
        raise RuntimeError("Execution failed")  # which re-raised it as an error of its own

    code, result = attempt(pipeline)
    assert code == ExitCode.RETRIABLE
    assert result["status"] == "partial" and result["error"]["code"] == "deadline_exceeded"


def test_a_real_failure_keeps_its_own_code(attempt: Any) -> None:
    def pipeline(att: job_main.Attempt) -> None:
        raise RuntimeError("EngineDeadError: the engine stopped")

    code, result = attempt(pipeline)
    assert code == ExitCode.RETRIABLE and result["error"]["code"] == "engine_dead"


def _invalid(line_no: int) -> Any:
    from llmbatch.ray_job.lines import rows

    payload = (
        orjson.dumps(
            {
                "id": f"e{line_no}",
                "custom_id": f"@line-{line_no}",
                "response": None,
                "error": {"code": "invalid_json_line", "message": "x", "line": line_no},
            }
        )
        + b"\n"
    )
    return rows.Row(line_no, rows.INVALID, f"@line-{line_no}", payload)


@pytest.mark.parametrize(("lines", "valid"), [(0, False), (3, False), (3, True)])
def test_a_batch_without_one_valid_request_fails_as_input_invalid(
    attempt: Any, tmp_path: Path, lines: int, valid: bool
) -> None:
    """Every line invalid, or an empty file: OpenAI fails such a batch, so does llmbatch (the error file
    still names each line); one valid request among them and the batch completes."""
    from llmbatch.ray_job.lines import rows

    (tmp_path / "results" / "default" / "b1").mkdir(parents=True)

    def pipeline(att: job_main.Attempt) -> None:
        att.consume([_invalid(n) for n in range(1, lines + 1)])
        if valid:
            att.consume([rows.Row(lines + 1, rows.OUTPUT, "ok", b'{"custom_id": "ok"}\n')])

    code, result = attempt(pipeline)
    assert code == ExitCode.OK
    counts = result["request_counts"]
    assert (counts["completed"], counts["failed"]) == (int(valid), lines)
    if valid:
        assert result["status"] == "completed" and result["error"] is None
    else:
        assert result["status"] == "failed" and result["error"]["code"] == "input_invalid"
        expected = "empty file" if lines == 0 else f"none of the {lines} input lines"
        assert expected in result["error"]["message"]
        manifest = orjson.loads((tmp_path / "results" / "default" / "b1" / "manifest.json").read_bytes())
        assert manifest["status"] == "failed" and manifest["error"]["code"] == "input_invalid"
