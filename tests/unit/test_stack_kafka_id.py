"""The KRaft cluster id the local stack formats Kafka with."""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest

from llmbatch.stack.kafka_broker import kafka_cluster_id

pytestmark = pytest.mark.unit


def test_an_id_that_would_read_as_an_option_is_drawn_again() -> None:
    # 0xf8 is 111110 in its top six bits: index 62, "-" in URL-safe base64
    draws: Iterator[bytes] = iter([b"\xf8" * 16, b"\xfb" + b"\x00" * 15, b"\x00" * 16])
    zeros = base64.urlsafe_b64encode(b"\x00" * 16).decode().rstrip("=")
    assert kafka_cluster_id(lambda: next(draws)) == zeros


def test_ids_are_22_url_safe_characters_never_starting_with_a_dash() -> None:
    ids = {kafka_cluster_id() for _ in range(2000)}  # about 31 of 2000 raw draws start with "-"
    assert len(ids) == 2000
    assert all(len(i) == 22 and not i.startswith("-") for i in ids)
    assert all(set(i) <= set("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_") for i in ids)
