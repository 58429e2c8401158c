"""Validating local files and in-memory requests before anything is uploaded."""

from __future__ import annotations

import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import pytest

from llmbatch.adapters.errors import InputFileError, InvalidInput
from llmbatch.producer.inputs import prepare_file, prepare_requests, write_jsonl
from llmbatch.schemas import BatchInputLine, Endpoint, parse_input_line
from llmbatch.schemas.errors import Reason

pytestmark = pytest.mark.unit

CHAT = Endpoint.CHAT_COMPLETIONS


def line(custom_id: str, **body: Any) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": CHAT.value,
        "body": {"messages": [{"role": "user", "content": f"q {custom_id}"}], **body},
    }


def write(path: Path, *rows: Any) -> Path:
    path.write_bytes(b"".join((r if isinstance(r, bytes) else json.dumps(r).encode()) + b"\n" for r in rows))
    return path


def test_valid_file_is_used_as_is_with_its_hash(tmp_path: Path) -> None:
    path = write(tmp_path / "in.jsonl", line("a"), b"", line("b", max_tokens=3))
    prepared = prepare_file(path, endpoint=CHAT, model="m")
    assert prepared.path == path
    assert not prepared.temporary
    assert (prepared.valid, prepared.skipped) == (2, 0)
    assert prepared.sha256 == hashlib.sha256(path.read_bytes()).hexdigest()
    assert prepared.size == path.stat().st_size
    prepared.cleanup()
    assert path.exists()  # the caller's file is never removed


def test_invalid_line_refuses_the_whole_file_naming_lines_and_fields(tmp_path: Path) -> None:
    path = write(tmp_path / "in.jsonl", line("a"), line("b", temperature=5), b"{oops", line("a"))
    with pytest.raises(InvalidInput) as info:
        prepare_file(path, endpoint=CHAT, model="m")
    error = info.value
    assert error.invalid_count == 3
    assert [(e.line, e.reason, e.field) for e in error.errors] == [
        (2, Reason.INVALID_FIELD, "body.temperature"),
        (3, Reason.INVALID_JSON, None),
        (4, Reason.DUPLICATE_CUSTOM_ID, "custom_id"),
    ]
    assert "3 invalid lines of 4" in error.message
    assert "line 2: body.temperature" in error.message
    assert error.retriable is False


def test_skip_invalid_keeps_valid_lines_byte_for_byte(tmp_path: Path) -> None:
    good_a = (
        b'{"custom_id": "a",   "method": "POST", "url": "/v1/chat/completions", '
        b'"body": {"messages": [{"role": "user", "content": "x"}]}}'
    )
    path = write(tmp_path / "in.jsonl", good_a, line("b", temperature=5), line("c"))
    prepared = prepare_file(path, endpoint=CHAT, model="m", skip_invalid=True)
    try:
        assert prepared.temporary
        assert prepared.path != path
        assert (prepared.valid, prepared.skipped) == (2, 1)
        content = prepared.path.read_bytes()
        assert content.splitlines()[0] == good_a
        assert [parse_input_line(raw).custom_id for raw in content.splitlines()] == ["a", "c"]
        assert prepared.sha256 == hashlib.sha256(content).hexdigest()
        assert prepared.size == len(content)
    finally:
        prepared.cleanup()
    assert not prepared.path.exists()


def test_file_without_trailing_newline_and_wrong_endpoint(tmp_path: Path) -> None:
    path = tmp_path / "in.jsonl"
    path.write_bytes(json.dumps(line("a")).encode())
    assert prepare_file(path, endpoint=CHAT, model="m").valid == 1
    with pytest.raises(InvalidInput) as info:
        prepare_file(path, endpoint=Endpoint.COMPLETIONS, model="m")
    assert info.value.errors[0].reason == Reason.URL_MISMATCH


def test_no_valid_lines_fails_even_with_skip_invalid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    path = write(tmp_path / "in.jsonl", b"[]", b"nope")
    with pytest.raises(InvalidInput, match=r"2 invalid lines of 2 \(no valid request lines\)"):
        prepare_file(path, endpoint=CHAT, model="m", skip_invalid=True)
    empty = tmp_path / "empty.jsonl"
    empty.write_bytes(b"\n\n")
    with pytest.raises(InvalidInput, match="no request lines"):
        prepare_file(empty, endpoint=CHAT, model="m")
    assert not list(scratch.iterdir())  # the filtered copy was removed


def test_unreadable_inputs(tmp_path: Path) -> None:
    with pytest.raises(InputFileError, match="no such file"):
        prepare_file(tmp_path / "missing.jsonl", endpoint=CHAT, model="m")
    with pytest.raises(InputFileError, match="is a directory"):
        prepare_file(tmp_path, endpoint=CHAT, model="m")


def test_prepare_requests_accepts_models_and_dicts() -> None:
    model_line = BatchInputLine.model_validate(line("a"))
    lines, report = prepare_requests([model_line, line("b")], endpoint=CHAT, model="m")
    assert [entry.custom_id for entry in lines] == ["a", "b"]
    assert (report.valid, report.invalid) == (2, 0)


def test_prepare_requests_reports_index_paths() -> None:
    rows = [
        line("a"),
        line("b", top_p=0),
        line("a"),
        {**line("c"), "url": "/v1/completions", "body": {"prompt": "p"}},
        line("d", model="other"),
    ]
    with pytest.raises(InvalidInput) as info:
        prepare_requests(rows, endpoint=CHAT, model="m")
    assert [(e.reason, e.field) for e in info.value.errors] == [
        (Reason.INVALID_FIELD, "requests[1].body.top_p"),
        (Reason.DUPLICATE_CUSTOM_ID, "requests[2].custom_id"),
        (Reason.URL_MISMATCH, "requests[3].url"),
        (Reason.MODEL_MISMATCH, "requests[4].body.model"),
    ]
    lines, report = prepare_requests(rows, endpoint=CHAT, model="m", skip_invalid=True)
    assert [entry.custom_id for entry in lines] == ["a"]
    assert report.invalid == 4
    with pytest.raises(InvalidInput, match="no valid requests"):
        prepare_requests([], endpoint=CHAT, model="m")


def test_write_jsonl_round_trips() -> None:
    lines = [BatchInputLine.model_validate(line(str(i))) for i in range(3)]
    prepared = write_jsonl(lines)
    try:
        content = prepared.path.read_bytes()
        assert [parse_input_line(raw) for raw in content.splitlines()] == lines
        assert prepared.sha256 == hashlib.sha256(content).hexdigest()
        assert prepared.valid == 3
    finally:
        prepared.cleanup()


def test_a_file_without_newlines_is_refused_in_bounded_memory(tmp_path: Path) -> None:
    """64 MiB with no newline (a binary uploaded by mistake): one line_too_large, never one 64 MiB line."""
    import tracemalloc

    path = tmp_path / "in.jsonl"
    with path.open("wb") as f:
        for _ in range(64):
            f.write(b"\x07" * (1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(InvalidInput) as info:
            prepare_file(path, endpoint=CHAT, model="m")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert [(e.line, e.reason) for e in info.value.errors] == [(1, Reason.LINE_TOO_LARGE)]
    assert peak < 32 << 20, peak
