"""A Redis reply item read as text: any bytes at all read back, never raise."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.state.store_indexes import reply_text

pytestmark = pytest.mark.unit


@given(st.binary())
def test_any_bytes_read_back_as_text(raw: bytes) -> None:
    text = reply_text(raw)
    assert isinstance(text, str)
    try:
        assert text == raw.decode("utf-8")
    except UnicodeDecodeError:
        assert "\ufffd" in text  # what is not UTF-8 is replaced, not raised


def test_str_and_numbers_pass_through() -> None:
    assert reply_text("tenant-a") == "tenant-a"
    assert reply_text(42) == "42"
    assert reply_text(b"t\xffx") == "t\ufffdx"
