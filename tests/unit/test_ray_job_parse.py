"""ray_job input parsing: every bad line becomes exactly one error line; done lines are skipped."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.parse import DoneKeys, count_request_lines, parse_lines
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.lines import split_lines
from llmbatch.schemas.openai import BatchOutputLine

pytestmark = pytest.mark.unit

CHAT = "/v1/chat/completions"


def line(custom_id: str | None = "r1", *, method: str = "POST", url: str = CHAT, **body: Any) -> bytes:
    obj: dict[str, Any] = {
        "method": method,
        "url": url,
        "body": body or {"messages": [{"role": "user", "content": "hi"}]},
    }
    if custom_id is not None:
        obj["custom_id"] = custom_id
    return orjson.dumps(obj)


def parse(lines: list[bytes], done: DoneKeys | None = None) -> list[rows.Row]:
    return list(parse_lines(lines, batch_id="b1", endpoint=Endpoint.CHAT_COMPLETIONS, model="m", done=done))


def error_of(row: rows.Row) -> dict[str, Any]:
    parsed = BatchOutputLine.model_validate_json(row.payload)
    assert parsed.error is not None and parsed.response is None
    return parsed.error.model_dump()


def test_each_kind_of_bad_line_gets_its_code_and_line_number() -> None:
    lines = [
        b"{not json",
        line(None),
        line("a"),
        line("a"),
        line("b", url="/v1/moderations", input="x"),
        line("c", method="GET"),
        line("d", url="/v1/completions", prompt="x"),
        line("e", messages=[{"role": "user", "content": "x"}], foo=1),
        line("f", messages=[{"role": "user", "content": "x"}], model="other"),
        b"   ",
        b"[1, 2]",
        line("g", messages=[{"role": "user", "content": "x"}], n=3),
    ]
    out = parse(lines)
    assert [r.line_no for r in out] == [1, 2, 3, 4, 5, 6, 7, 8, 9, 11, 12]  # blank line 10 skipped
    assert [r.kind for r in out].count(rows.REQUEST) == 1
    codes = {r.line_no: error_of(r)["code"] for r in out if r.kind == rows.INVALID}
    assert codes == {
        1: "invalid_json_line",
        2: "missing_required_parameter",
        4: "duplicate_custom_id",
        5: "invalid_value",
        6: "invalid_value",
        7: "invalid_url",
        8: "unsupported_parameter",
        9: "mismatched_model",
        11: "invalid_json_line",
        12: "invalid_value",
    }
    by_line = {r.line_no: r for r in out}
    assert by_line[1].custom_id == "@line-1"  # unreadable custom_id gets a placeholder
    assert by_line[4].custom_id == "a"  # duplicates keep the caller's custom_id
    assert all(error_of(r)["line"] == r.line_no for r in out if r.kind == rows.INVALID)
    assert error_of(by_line[6])["param"] == "method"


def test_request_rows_carry_the_callers_body_verbatim() -> None:
    body: dict[str, Any] = {
        "messages": [{"role": "user", "content": "hi"}],
        "temperature": 0.5,
        "max_tokens": 7,
    }
    (row,) = parse([line("x", **body)])
    assert row.kind == rows.REQUEST and row.custom_id == "x" and row.line_no == 1
    assert orjson.loads(row.payload) == {"url": CHAT, "body": body}


def test_done_keys_skip_finished_lines_but_duplicates_are_still_detected() -> None:
    lines = [line("a"), line("b"), b"oops", line("a"), line("c")]
    done = DoneKeys(custom_ids={"a"}, lines={3})
    out = parse(lines, done)
    # a (line 1) done, b runs, line 3 error already written, line 4 is still a duplicate of a
    assert [(r.line_no, r.kind) for r in out] == [(2, rows.REQUEST), (4, rows.INVALID), (5, rows.REQUEST)]
    assert error_of(out[1])["code"] == "duplicate_custom_id"
    done.add_line(4)
    assert [r.line_no for r in parse(lines, done)] == [2, 5]


def test_ids_differ_between_a_request_and_its_duplicate() -> None:
    out = parse([line("a"), line("a")])
    assert orjson.loads(out[1].payload)["id"].startswith("batch_req_")
    again = parse([line("a"), line("a")])
    assert out[1].payload == again[1].payload  # deterministic across attempts


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_split_and_count_lines_across_chunk_boundaries(size: int) -> None:
    data = b'{"a":1}\n\n  \n{"b":2}\r\n{"c":3}'
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    assert list(split_lines(chunks)) == [b'{"a":1}', b"", b"  ", b'{"b":2}\r', b'{"c":3}']
    assert count_request_lines(chunks) == 3
    assert count_request_lines([data + b"\n"]) == 3
    assert count_request_lines([]) == 0


def test_a_line_over_the_limit_is_a_line_too_large_error_and_the_rest_run() -> None:
    big = orjson.dumps(
        {
            "custom_id": "huge",
            "method": "POST",
            "url": CHAT,  # custom_id first, as usual
            "body": {"messages": [{"role": "user", "content": "y" * 50_000}]},
        }
    )
    data = b"\n".join([line("a"), big, b'{"x": "' + b"z" * 50_000, line("b")])
    got = list(
        parse_lines(
            split_lines([data], 4096),
            batch_id="b1",
            endpoint=Endpoint.CHAT_COMPLETIONS,
            model="m",
            max_line_bytes=4096,
        )
    )
    assert [(r.line_no, r.kind, r.custom_id) for r in got] == [
        (1, rows.REQUEST, "a"),
        (2, rows.INVALID, "huge"),
        (3, rows.INVALID, "@line-3"),
        (4, rows.REQUEST, "b"),
    ]
    assert error_of(got[1])["code"] == "line_too_large" and "4096 bytes" in error_of(got[1])["message"]


def test_the_reader_task_applies_the_specs_line_limit() -> None:
    from llmbatch.ray_job.job.reader import Source, iter_blocks

    data = b"\n".join([line("a"), b"q" * 10_000, line("b")])
    source = Source(batch_id="b1", endpoint=CHAT, model="m", inline=data, max_line_bytes=2048)
    got = [row for block in iter_blocks(source) for row in block]
    assert [(r.line_no, r.kind) for r in got] == [(1, rows.REQUEST), (2, rows.INVALID), (3, rows.REQUEST)]
    assert error_of(got[1])["code"] == "line_too_large"
