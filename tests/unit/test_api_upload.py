"""The upload validator (api.files.upload): the producer's line rules, one endpoint and model per file, line
numbers in every error, bounded by size and request count, the same answer however the bytes are
chunked (hypothesis)."""

from __future__ import annotations

import hashlib
import itertools
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from llmbatch.adapters.errors import InvalidInput
from llmbatch.api.files.upload import ValidatedFile, validate_batch_file
from llmbatch.schemas import SchemaError, parse_input_line
from llmbatch.schemas.errors import Reason
from tests.support.api_fakes import MODEL, chat_line, jsonl

pytestmark = pytest.mark.unit


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts} | {0, len(data)})
    return [data[a:b] for a, b in itertools.pairwise(points)]


def outcome(chunks: list[bytes], **limits: Any) -> ValidatedFile | tuple[int | None, ...]:
    """The result, or the line numbers of the errors."""
    try:
        return validate_batch_file(chunks, **limits)
    except InvalidInput as exc:
        return tuple(e.line for e in exc.errors)


def test_a_valid_file_is_described() -> None:
    data = jsonl(chat_line("a"), b"", chat_line("b", max_tokens=4), b"   ")
    result = validate_batch_file([data])
    assert result == ValidatedFile(len(data), hashlib.sha256(data).hexdigest(), 2, result.endpoint, MODEL)
    assert result.endpoint.value == "/v1/chat/completions"


def test_completions_files_are_valid_too() -> None:
    line = {
        "custom_id": "p",
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": MODEL, "prompt": "x"},
    }
    assert validate_batch_file([jsonl(line)]).endpoint.value == "/v1/completions"


def errors_of(data: bytes, **limits: Any) -> list[SchemaError]:
    with pytest.raises(InvalidInput) as caught:
        validate_batch_file([data], **limits)
    return caught.value.errors


def test_bad_lines_are_named_by_number_with_the_field() -> None:
    data = jsonl(chat_line("a"), b"{not json", chat_line("c", temperature=9), chat_line("a"))
    errors = errors_of(data)
    assert [(e.line, e.reason) for e in errors] == [
        (2, Reason.INVALID_JSON),
        (3, Reason.INVALID_FIELD),
        (4, Reason.DUPLICATE_CUSTOM_ID),
    ]
    assert errors[1].field == "body.temperature"
    assert "line 1" in errors[2].message  # where the custom_id was first used


def test_every_line_names_the_same_model_and_endpoint() -> None:
    data = jsonl(
        chat_line("a"),
        chat_line("b", model=None),
        chat_line("c", model="other/model"),
        {**chat_line("d"), "url": "/v1/completions", "body": {"model": MODEL, "prompt": "x"}},
    )
    errors = errors_of(data)
    assert [(e.line, e.reason, e.field) for e in errors] == [
        (2, Reason.MISSING_FIELD, "body.model"),
        (3, Reason.MODEL_MISMATCH, "body.model"),
        (4, Reason.URL_MISMATCH, "url"),
    ]
    assert "line 1" in errors[1].message and "line 1" in errors[2].message


def test_the_first_valid_line_fixes_model_and_endpoint() -> None:
    data = jsonl(b"[]", chat_line("a", model="other/model"), chat_line("b"))
    found = [(e.line, e.reason) for e in errors_of(data)]
    assert found == [(1, Reason.INVALID_JSON), (3, Reason.MODEL_MISMATCH)]


def test_an_empty_file_is_refused() -> None:
    assert errors_of(b"\n \n")[0].reason == Reason.EMPTY_INPUT
    assert errors_of(b"")[0].reason == Reason.EMPTY_INPUT


def test_a_line_over_the_limit_is_refused_unread() -> None:
    big = json.dumps(chat_line("big", user="x" * 5000)).encode()
    errors = errors_of(jsonl(chat_line("a")) + big + b"\n", max_line_bytes=1000)
    assert [(e.line, e.reason, e.custom_id) for e in errors] == [(2, Reason.LINE_TOO_LARGE, "big")]


def test_size_and_request_limits() -> None:
    data = jsonl(*(chat_line(str(i)) for i in range(5)))
    assert errors_of(data, max_requests=4)[0].reason == Reason.LIMIT_EXCEEDED
    assert validate_batch_file([data], max_requests=5).requests == 5
    assert errors_of(data, max_bytes=len(data) - 1)[0].reason == Reason.LIMIT_EXCEEDED
    assert validate_batch_file([data], max_bytes=len(data)).size == len(data)


def test_errors_are_capped_but_counted() -> None:
    data = jsonl(*([b"{"] * 30))
    with pytest.raises(InvalidInput) as caught:
        validate_batch_file([data], max_errors=5)
    assert len(caught.value.errors) == 5 and caught.value.invalid_count == 30
    assert "30 invalid lines of 30" in caught.value.message


# --- fuzz -----------------------------------------------------------------------------------------

_valid = st.builds(
    lambda cid, tokens: json.dumps(chat_line(cid, max_tokens=tokens)).encode(),
    st.text(st.characters(codec="utf-8"), min_size=1, max_size=12),
    st.integers(min_value=1, max_value=64),
)
_near = st.sampled_from(
    [  # lines one rule away from valid
        b"",
        b"  ",
        b"{}",
        b"[]",
        b"null",
        b'{"custom_id": "x"}',
        b"\xff\xfe",
        json.dumps(chat_line("m", model="other/m")).encode(),
        json.dumps(chat_line("n", model=None)).encode(),
        json.dumps({**chat_line("u"), "url": "/v1/completions"}).encode(),
        json.dumps(
            {
                "custom_id": "c",
                "method": "POST",
                "url": "/v1/completions",
                "body": {"model": MODEL, "prompt": "x"},
            }
        ).encode(),
        json.dumps(chat_line("t", temperature=7)).encode(),
    ]
)
_binary = st.binary(max_size=40).filter(lambda b: b"\n" not in b)
_lines = st.lists(st.one_of(_valid, _valid, _near, _binary), max_size=12)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    lines=_lines,
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=8),
    final_newline=st.booleans(),
)
def test_fuzz_any_bytes_any_chunking(lines: list[bytes], cuts: list[int], final_newline: bool) -> None:
    data = b"\n".join(lines) + (b"\n" if final_newline and lines else b"")
    whole = outcome([data])
    # the answer does not depend on how the upload arrives
    assert outcome(chunked(data, cuts)) == whole
    numbered = [(n, line) for n, line in enumerate(data.split(b"\n"), start=1) if line.strip()]
    if isinstance(whole, ValidatedFile):
        assert whole.size == len(data) and whole.sha256 == hashlib.sha256(data).hexdigest()
        assert whole.requests == len(numbered)
        parsed = [parse_input_line(line, n) for n, line in numbered]  # every line stands on its own
        assert {p.body["model"] for p in parsed} == {whole.model}
        assert {p.url for p in parsed} == {whole.endpoint}
        assert len({p.custom_id for p in parsed}) == len(parsed)
    else:
        non_blank = {n for n, _ in numbered}
        if not non_blank:
            assert whole == (None,)  # empty file
        else:
            lines_named = [n for n in whole if n is not None]
            assert lines_named == list(whole)  # every error names its line ...
            assert set(lines_named) <= non_blank and lines_named == sorted(lines_named)  # ... a real one


@settings(max_examples=60, deadline=None)
@given(
    good=st.lists(_valid, min_size=1, max_size=8, unique=True),
    position=st.integers(min_value=0),
    bad=st.sampled_from([b"{", b"[]", json.dumps(chat_line("z", temperature=7)).encode()]),
)
def test_fuzz_one_bad_line_is_found_where_it_is(good: list[bytes], position: int, bad: bytes) -> None:
    ids = [json.loads(line)["custom_id"] for line in good]
    assume(len(set(ids)) == len(ids) and "z" not in ids)
    at = position % (len(good) + 1)
    lines = [*good[:at], bad, *good[at:]]
    assert outcome([b"\n".join(lines)]) == (at + 1,)


def oracle(data: bytes) -> tuple[int | None, ...] | None:
    """The error lines the rules give, line by line, written the plain way (``None``: valid)."""
    errors: list[int | None] = []
    seen: set[str] = set()
    first: tuple[str, str] | None = None
    numbered = [(n, line) for n, line in enumerate(data.split(b"\n"), start=1) if line.strip()]
    for n, line in numbered:
        try:
            parsed = parse_input_line(line, n)
        except SchemaError:
            errors.append(n)
            continue
        if parsed.custom_id in seen:
            errors.append(n)
            continue
        seen.add(parsed.custom_id)
        model = parsed.body.get("model")
        if not isinstance(model, str):
            errors.append(n)
        elif first is None:
            first = (parsed.url.value, model)
        elif first != (parsed.url.value, model):
            errors.append(n)
    if not numbered:
        return (None,)
    return tuple(errors) or None


@settings(max_examples=200, deadline=None)
@given(
    lines=st.lists(st.one_of(_valid, _near), max_size=10),
    cuts=st.lists(st.integers(min_value=0, max_value=10_000), max_size=6),
)
def test_fuzz_the_validator_agrees_with_the_rules_line_by_line(lines: list[bytes], cuts: list[int]) -> None:
    data = b"\n".join(lines)
    got = outcome(chunked(data, cuts))
    expected = oracle(data)
    assert (None if isinstance(got, ValidatedFile) else got) == expected
