"""producer/llmbatch/producer/cli_args.py: option values into endpoints, metadata and times, or one
CliFailure naming the
option and the fix."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.producer.cli_args import (
    CliFailure,
    parse_deadline,
    parse_endpoint,
    parse_metadata,
    parse_since,
)
from llmbatch.schemas import Endpoint, utcnow

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "endpoint"),
    [
        ("chat", Endpoint.CHAT_COMPLETIONS),
        (" Chat/Completions ", Endpoint.CHAT_COMPLETIONS),
        ("completions", Endpoint.COMPLETIONS),
        ("embeddings", Endpoint.EMBEDDINGS),
        ("/v1/chat/completions", Endpoint.CHAT_COMPLETIONS),
    ],
)
def test_endpoints_by_alias_or_path(value: str, endpoint: Endpoint) -> None:
    assert parse_endpoint(value) is endpoint


def test_an_unknown_endpoint_names_the_ones_there_are() -> None:
    with pytest.raises(CliFailure, match="unknown endpoint 'moderations': use chat"):
        parse_endpoint("moderations")


def test_metadata_pairs_split_at_the_first_equals_sign() -> None:
    assert parse_metadata(["team=search", "q=a=b", "empty="]) == {"team": "search", "q": "a=b", "empty": ""}
    for bad in ("novalue", "=x"):
        with pytest.raises(CliFailure, match=f"--metadata '{bad}': use key=value"):
            parse_metadata([bad])


def test_since_is_a_duration_ago_and_deadline_a_duration_from_now() -> None:
    before = utcnow()
    since, deadline = parse_since("2h"), parse_deadline("2h")
    after = utcnow()
    assert since is not None and deadline is not None
    assert before - timedelta(hours=2) <= since <= after - timedelta(hours=2)
    assert before + timedelta(hours=2) <= deadline <= after + timedelta(hours=2)
    assert parse_since(None) is None and parse_deadline(None) is None


def test_times_need_their_offset() -> None:
    assert parse_since("2026-01-02T03:04:05+01:00") == datetime(2026, 1, 2, 2, 4, 5, tzinfo=UTC)
    with pytest.raises(
        CliFailure,
        match=r"--deadline '2099-01-01T00:00:00': add a UTC offset, e\.g\. "
        r"2099-01-01T00:00:00Z",
    ):
        parse_deadline("2099-01-01T00:00:00")
    with pytest.raises(CliFailure, match="--since 'last tuesday': use a duration such as 30m"):
        parse_since("last tuesday")
    with pytest.raises(CliFailure, match="--deadline 'someday': use an RFC 3339 time"):
        parse_deadline("someday")


@given(st.text(max_size=40))
def test_any_text_is_a_time_or_one_failure_naming_the_option(value: str) -> None:
    for parse, option in ((parse_since, "--since"), (parse_deadline, "--deadline")):
        message = ""
        try:
            parsed = parse(value)
        except CliFailure as exc:
            message = str(exc)
        if message:
            assert message.startswith(f"{option} ")
        else:
            assert parsed is not None and parsed.tzinfo is not None
