"""``GET /v1/usage`` through the real app: the range is checked and named, and the bytes a tenant
stores are its own files' (the usage itself, from real Redis: tests/integration/test_usage_record.py)."""

from __future__ import annotations

from tests.support.api_fakes import T0, chat_line, jsonl, make_api


def test_a_range_that_is_not_one_is_named() -> None:
    api = make_api()
    for query, param in (
        (f"start_time={int(T0)}&end_time={int(T0) - 1}", "start_time"),
        (f"start_time={int(T0) + 10}", "start_time"),  # after now
        (f"start_time={int(T0) - 500 * 86400}", "end_time"),  # over 400 days
        ("start_time=yesterday", "start_time"),
    ):
        answer = api.client.get(f"/v1/usage?{query}", headers=api.auth())
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, (query, answer.text)


def test_stored_bytes_are_the_tenants_own() -> None:
    api = make_api()
    data = jsonl(*(chat_line(f"r{i}") for i in range(4)))
    assert api.upload(data, tenant="acme").status_code == 200
    mine = api.client.get(f"/v1/usage?start_time={int(T0) - 86400}", headers=api.auth()).json()
    theirs = api.client.get(f"/v1/usage?start_time={int(T0) - 86400}", headers=api.auth("globex")).json()
    assert mine["data"] == [] and theirs["stored_bytes"] == 0
    assert mine["stored_bytes"] >= len(data)  # the file and its record
