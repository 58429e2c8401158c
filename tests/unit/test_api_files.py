"""The Files endpoints through the real app over in-memory storage: upload (validated, stored byte for
byte), list (newest first, pages), retrieve, content (streamed), delete, and result files made of a
batch's shards."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from llmbatch.api.batches.results import concatenate
from llmbatch.api.batches.status import error_file_id, output_file_id
from llmbatch.api.files.files import clean_filename
from llmbatch.api.store.records import FILE_ID
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.states import State
from tests.support.api_fakes import (
    INPUT_BUCKET,
    RESULTS_BUCKET,
    ApiHarness,
    MemoryObjectStore,
    chat_line,
    jsonl,
    make_api,
)

pytestmark = pytest.mark.unit


def upload_ok(api: ApiHarness, data: bytes, **kwargs: Any) -> dict[str, Any]:
    answer = api.upload(data, **kwargs)
    assert answer.status_code == 200, answer.text
    return dict(answer.json())


def test_an_upload_is_stored_byte_for_byte_and_described() -> None:
    api = make_api()
    data = jsonl(chat_line("a"), b"", chat_line("b", max_tokens=3))
    described = upload_ok(api, data, filename="../../etc/evals.jsonl")
    assert FILE_ID.fullmatch(described["id"])
    assert described["object"] == "file" and described["purpose"] == "batch"
    assert described["bytes"] == len(data) and described["created_at"] == int(api.clock.now)
    assert described["filename"] == "evals.jsonl" and described["status"] == "processed"
    key = f"acme/files/{described['id']}.jsonl"
    assert api.objects.objects[(INPUT_BUCKET, key)] == data
    assert f"acme/api/files/{described['id']}.json" in api.objects.keys(INPUT_BUCKET)


def test_filenames_are_cleaned() -> None:
    assert clean_filename("C:\\data\\in\x07.jsonl") == "in.jsonl"
    assert clean_filename("") == clean_filename(None) == "file.jsonl"
    assert len(clean_filename("a" * 1000)) == 255


def test_a_file_with_bad_lines_is_refused_naming_them_and_nothing_is_stored() -> None:
    api = make_api()
    answer = api.upload(jsonl(chat_line("a"), b"{oops", chat_line("c", temperature=5), chat_line("a")))
    assert answer.status_code == 400
    error = answer.json()["error"]
    assert error["param"] == "file" and error["type"] == "invalid_request_error"
    for number in ("line 2", "line 3", "line 4"):
        assert number in error["message"]
    assert "body.temperature" in error["message"] and "already used on line 1" in error["message"]
    assert api.objects.keys(INPUT_BUCKET) == []


@pytest.mark.parametrize(
    ("form", "files", "param"),
    [
        ({"purpose": "fine-tune"}, True, "purpose"),
        ({}, True, "purpose"),
        ({"purpose": "batch"}, False, "file"),
        ({"purpose": "batch", "colour": "red"}, True, "colour"),
        ({"purpose": "batch", "expires_after[anchor]": "created_at"}, True, "expires_after"),
        ({"purpose": "batch", "expires_after[seconds]": "3600"}, True, "expires_after"),
        (
            {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "60"},
            True,
            "expires_after.seconds",
        ),
        (
            {"purpose": "batch", "expires_after[anchor]": "created_at", "expires_after[seconds]": "1h"},
            True,
            "expires_after.seconds",
        ),
        (
            {"purpose": "batch", "expires_after[anchor]": "now", "expires_after[seconds]": "3600"},
            True,
            "expires_after.anchor",
        ),
    ],
)
def test_form_mistakes_name_the_field(form: dict[str, str], files: bool, param: str) -> None:
    api = make_api()
    upload = {"file": ("in.jsonl", jsonl(chat_line("a")), "application/jsonl")} if files else None
    answer = api.client.post("/v1/files", headers=api.auth(), data=form, files=upload)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == param
    assert api.objects.keys(INPUT_BUCKET) == []


def test_a_json_body_instead_of_a_form_is_told_what_to_send() -> None:
    api = make_api()
    answer = api.client.post("/v1/files", headers=api.auth(), json={"purpose": "batch"})
    assert answer.status_code == 400 and answer.json()["error"]["param"] in {"purpose", "file"}


def test_empty_and_single_model_rules() -> None:
    api = make_api()
    assert api.upload(b"\n\n").json()["error"]["param"] == "file"
    answer = api.upload(jsonl(chat_line("a"), chat_line("b", model="other/model")))
    assert answer.status_code == 400 and "line 2" in answer.json()["error"]["message"]


def test_files_list_newest_first_in_pages() -> None:
    api = make_api()
    ids = []
    for i in range(5):
        api.clock.now += 1
        ids.append(upload_ok(api, jsonl(chat_line(f"x{i}")), filename=f"f{i}.jsonl")["id"])
    newest_first = list(reversed(ids))
    page = api.client.get("/v1/files?limit=2", headers=api.auth()).json()
    assert [f["id"] for f in page["data"]] == newest_first[:2]
    assert page["has_more"] and page["first_id"] == newest_first[0] and page["last_id"] == newest_first[1]
    page = api.client.get(f"/v1/files?limit=2&after={page['last_id']}", headers=api.auth()).json()
    assert [f["id"] for f in page["data"]] == newest_first[2:4] and page["has_more"]
    page = api.client.get(f"/v1/files?limit=2&after={page['last_id']}", headers=api.auth()).json()
    assert [f["id"] for f in page["data"]] == newest_first[4:] and not page["has_more"]
    every = api.client.get("/v1/files", headers=api.auth()).json()
    assert [f["id"] for f in every["data"]] == newest_first and not every["has_more"]
    oldest = api.client.get("/v1/files?order=asc&limit=3", headers=api.auth()).json()
    assert [f["id"] for f in oldest["data"]] == ids[:3] and oldest["has_more"]
    rest = api.client.get(f"/v1/files?order=asc&after={ids[2]}", headers=api.auth()).json()
    assert [f["id"] for f in rest["data"]] == ids[3:]
    assert api.client.get("/v1/files?purpose=assistants", headers=api.auth()).json()["data"] == []
    for query, param in (("limit=0", "limit"), ("order=up", "order"), ("after=nope", "after")):
        answer = api.client.get(f"/v1/files?{query}", headers=api.auth())
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param


def test_retrieve_content_and_delete() -> None:
    api = make_api()
    data = jsonl(chat_line("a"), chat_line("b"))
    file_id = upload_ok(api, data)["id"]
    got = api.client.get(f"/v1/files/{file_id}", headers=api.auth()).json()
    assert got["id"] == file_id and got["bytes"] == len(data)
    content = api.client.get(f"/v1/files/{file_id}/content", headers=api.auth())
    assert content.status_code == 200 and content.content == data
    deleted = api.client.delete(f"/v1/files/{file_id}", headers=api.auth())
    assert deleted.json() == {"id": file_id, "object": "file", "deleted": True}
    assert api.objects.keys(INPUT_BUCKET) == []
    for path in (f"/v1/files/{file_id}", f"/v1/files/{file_id}/content"):
        answer = api.client.get(path, headers=api.auth())
        assert answer.status_code == 404 and answer.json()["error"]["param"] == "file_id"
    assert api.client.delete(f"/v1/files/{file_id}", headers=api.auth()).status_code == 404


def _finished_batch(api: ApiHarness, outputs: list[bytes], errors: list[bytes]) -> str:
    file_id = upload_ok(api, jsonl(chat_line("a"), chat_line("b")))["id"]
    api.client.post(
        "/v1/batches", headers=api.auth(), json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    )
    (batch_id,) = api.accept_all()
    uris: dict[str, list[str]] = {"output": [], "error": []}
    for kind, shards in (("output", outputs), ("error", errors)):
        for n, shard in enumerate(shards):
            uri = f"s3://llmbatch-results/acme/{batch_id}/l1/{kind}-a{n + 1}-00000.jsonl"
            api.write_shard(uri, shard)
            uris[kind].append(uri)
    api.dispatcher.run(batch_id, api.clock.now)
    outcome = Outcome(State.COMPLETED, api.clock.now + 5, uris["output"], uris["error"])
    api.dispatcher.finish(batch_id, outcome)
    return batch_id


def test_result_files_are_the_shards_in_order_as_one_file() -> None:
    api = make_api()
    shards = [b'{"n": 1}\n{"n": 2}\n', b'{"n": 3}', b'{"n": 4}\n']  # the second lacks its newline
    batch_id = _finished_batch(api, shards, [b'{"e": 1}\n'])
    batch = api.client.get(f"/v1/batches/{batch_id}", headers=api.auth()).json()
    assert batch["output_file_id"] == output_file_id(batch_id)
    described = api.client.get(f"/v1/files/{output_file_id(batch_id)}", headers=api.auth()).json()
    assert described["purpose"] == "batch_output" and described["bytes"] == sum(len(s) for s in shards)
    assert described["filename"] == f"{batch_id}_output.jsonl"
    content = api.client.get(f"/v1/files/{output_file_id(batch_id)}/content", headers=api.auth()).content
    assert content == b'{"n": 1}\n{"n": 2}\n{"n": 3}\n{"n": 4}\n'
    errors = api.client.get(f"/v1/files/{error_file_id(batch_id)}/content", headers=api.auth()).content
    assert errors == b'{"e": 1}\n'
    answer = api.client.delete(f"/v1/files/{output_file_id(batch_id)}", headers=api.auth())
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "file_id"


def test_a_result_file_exists_only_once_the_batch_ended_with_such_lines() -> None:
    api = make_api()
    batch_id = _finished_batch(api, [b'{"n": 1}\n'], [])
    assert api.client.get(f"/v1/files/{error_file_id(batch_id)}", headers=api.auth()).status_code == 404
    file_id = upload_ok(api, jsonl(chat_line("q")))["id"]
    body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    running = api.client.post("/v1/batches", headers=api.auth(), json=body).json()["id"]
    answer = api.client.get(f"/v1/files/{output_file_id(running)}/content", headers=api.auth())
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "file_id"
    assert api.client.get(f"/v1/files/{output_file_id('batch_nope')}", headers=api.auth()).status_code == 404


def test_a_missing_shard_is_not_found_rather_than_a_truncated_file() -> None:
    api = make_api()
    batch_id = _finished_batch(api, [b'{"n": 1}\n', b'{"n": 2}\n'], [])
    key = next(k for k in api.objects.keys("llmbatch-results") if "output-a2" in k)
    del api.objects.objects[("llmbatch-results", key)]
    answer = api.client.get(f"/v1/files/{output_file_id(batch_id)}/content", headers=api.auth())
    assert answer.status_code == 404


def test_concatenation_holds_one_chunk_at_a_time() -> None:
    objects = MemoryObjectStore()
    objects.objects[("b", "one")] = b"x" * 200_000 + b"\n"
    objects.objects[("b", "two")] = b"y" * 100_000

    async def collect() -> list[bytes]:
        return [chunk async for chunk in concatenate(objects, ["s3://b/one", "s3://b/two"])]

    chunks = asyncio.run(collect())
    assert b"".join(chunks) == b"x" * 200_000 + b"\n" + b"y" * 100_000 + b"\n"
    assert max(len(c) for c in chunks) <= 1 << 16 and len(chunks) > 4


def _batch_of(api: ApiHarness, file_id: str) -> str:
    answer = api.client.post(
        "/v1/batches", headers=api.auth(), json={"input_file_id": file_id, "endpoint": "/v1/chat/completions"}
    )
    assert answer.status_code == 200, answer.text
    return str(answer.json()["id"])


def test_a_file_a_batch_may_still_read_is_not_deleted_until_the_batch_ended() -> None:
    """Before, the delete went through and the queued batch failed ``input_not_found`` when it started."""
    api = make_api()
    data = jsonl(chat_line("a"))
    file_id = upload_ok(api, data)["id"]
    other = upload_ok(api, jsonl(chat_line("b")))["id"]
    _batch_of(api, other)  # another file's batch does not hold this one
    batch_id = _batch_of(api, file_id)
    for step in ("validating", "in_progress"):
        if step == "in_progress":
            api.accept_all()
            api.dispatcher.run(batch_id, api.clock.now)
        answer = api.client.delete(f"/v1/files/{file_id}", headers=api.auth())
        assert answer.status_code == 409, (step, answer.text)
        error = answer.json()["error"]
        assert error["code"] == "file_in_use" and error["param"] == "file_id"
        assert batch_id in error["message"] and step in error["message"]
        # nothing of the file went
        assert api.client.get(f"/v1/files/{file_id}/content", headers=api.auth()).content == data
    api.dispatcher.finish(batch_id, Outcome(State.COMPLETED, api.clock.now + 5, [], []))
    assert api.client.delete(f"/v1/files/{file_id}", headers=api.auth()).status_code == 200
    assert api.client.get(f"/v1/files/{file_id}", headers=api.auth()).status_code == 404


def test_a_batch_that_never_reached_the_dispatcher_holds_its_file_only_within_its_window() -> None:
    api = make_api()
    file_id = upload_ok(api, jsonl(chat_line("a")))["id"]
    _batch_of(api, file_id)  # never taken in (its event was lost): sent again while in its window
    assert api.client.delete(f"/v1/files/{file_id}", headers=api.auth()).status_code == 409
    api.clock.now += 25 * 3600  # past the default 24 h window: it is not sent again any more
    assert api.client.delete(f"/v1/files/{file_id}", headers=api.auth()).status_code == 200


class LandsDuringDelete(MemoryObjectStore):
    """``landing`` (a key's ending, an object): once a key with that ending is deleted, the object
    lands, as a concurrent create's write does."""

    landing: tuple[str, tuple[str, str], bytes] | None = None

    async def delete(self, bucket: str, key: str) -> None:
        await super().delete(bucket, key)
        if self.landing is not None and key.endswith(self.landing[0]):
            self.objects[self.landing[1]] = self.landing[2]


def test_a_create_that_found_the_file_while_it_was_being_deleted_keeps_it() -> None:
    """The create marks its use before it reads the file's record; the delete looks again after removing
    the record, so a create that read it in between is seen, and the record is put back."""
    objects = LandsDuringDelete()
    api = make_api(objects=objects)
    data = jsonl(chat_line("a"))
    file_id = upload_ok(api, data)["id"]
    batch_id = _batch_of(api, file_id)
    marker = next(k for k in api.objects.keys(INPUT_BUCKET) if k.endswith(f"/file-uses/{file_id}/{batch_id}"))
    use = api.objects.objects.pop((INPUT_BUCKET, marker))  # not there at the delete's first look
    objects.landing = (f"/api/files/{file_id}.json", (INPUT_BUCKET, marker), use)
    answer = api.client.delete(f"/v1/files/{file_id}", headers=api.auth())
    assert answer.status_code == 409 and answer.json()["error"]["code"] == "file_in_use"
    assert api.client.get(f"/v1/files/{file_id}", headers=api.auth()).status_code == 200
    assert api.client.get(f"/v1/files/{file_id}/content", headers=api.auth()).content == data


def test_a_create_of_a_missing_file_is_not_found_and_holds_nothing() -> None:
    api = make_api()
    answer = api.client.post(
        "/v1/batches",
        headers=api.auth(),
        json={"input_file_id": f"file-{'0' * 29}", "endpoint": "/v1/chat/completions"},
    )
    assert answer.status_code == 404 and answer.json()["error"]["param"] == "input_file_id"
    file_id = upload_ok(api, jsonl(chat_line("a")))["id"]
    bad = api.client.post(
        "/v1/batches", headers=api.auth(), json={"input_file_id": file_id, "endpoint": "/v1/completions"}
    )
    assert bad.status_code == 400  # the endpoint does not match: no batch, so the file is free
    assert api.client.delete(f"/v1/files/{file_id}", headers=api.auth()).status_code == 200


def test_an_upload_over_the_tenants_storage_quota_is_429_until_files_are_deleted() -> None:
    data = jsonl(chat_line("a"), chat_line("b"))
    api = make_api(storage_limits={"*": 2 * len(data) + 10})
    first = upload_ok(api, data)["id"]
    upload_ok(api, data)
    answer = api.upload(data)
    assert answer.status_code == 429, answer.text
    error = answer.json()["error"]
    assert (error["type"], error["code"]) == ("insufficient_quota", "storage_quota_exceeded")
    assert error["param"] == "file" and "LLMBATCH_TENANTS__MAX_STORED_BYTES" in error["message"]
    assert f"the {2 * len(data)} bytes of files you uploaded" in error["message"]
    assert len([k for k in api.objects.keys(INPUT_BUCKET) if "/files/" in k and "/api/" not in k]) == 2
    upload_ok(api, data, tenant="globex")  # each tenant has its own quota
    assert api.client.delete(f"/v1/files/{first}", headers=api.auth()).status_code == 200
    upload_ok(api, data)  # room again
    big = jsonl(*(chat_line(f"c{i}") for i in range(100)))
    assert make_api().upload(big).status_code == 200  # none: no limit


def test_a_tenants_results_count_against_its_storage_quota() -> None:
    data = jsonl(chat_line("a"), chat_line("b"))
    api = make_api(storage_limits={"*": 2 * len(data) + 10})
    upload_ok(api, data)
    # the results a batch of the tenant left (the shards a job wrote): with them a second upload is over
    api.objects.objects[(RESULTS_BUCKET, "acme/b1/0123456789/output-a1-00000.jsonl")] = b"x" * 11
    answer = api.upload(data, tenant="acme")
    assert answer.status_code == 429
    assert "the 11 bytes of your batches' results" in answer.json()["error"]["message"]
    api.objects.objects[(RESULTS_BUCKET, "globex/b2/0123456789/output-a1-00000.jsonl")] = b"x" * (
        len(data) * 9
    )
    assert api.upload(data, tenant="globex").status_code == 429  # its results alone fill its quota


def test_result_files_are_listed_under_purpose_batch_output_in_pages() -> None:
    """Before, ``GET /v1/files`` had no way to list them (``purpose=batch_output`` gave an empty list)."""
    api = make_api()
    first = _finished_batch(api, [b'{"n": 1}\n'], [b'{"e": 1}\n'])
    api.clock.now += 10
    file_id = upload_ok(api, jsonl(chat_line("r")))["id"]
    running = _batch_of(api, file_id)
    api.accept_all()
    api.dispatcher.run(running, api.clock.now)
    api.clock.now += 10
    last = _finished_batch(api, [b'{"n": 2}\n', b'{"n": 3}\n'], [])

    def listed(**params: Any) -> dict[str, Any]:
        answer = api.client.get("/v1/files", headers=api.auth(), params={"purpose": "batch_output", **params})
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    everything = listed()
    ids = [f["id"] for f in everything["data"]]
    assert ids == [output_file_id(last), output_file_id(first), error_file_id(first)]
    assert {f["purpose"] for f in everything["data"]} == {"batch_output"}
    assert everything["data"][0]["bytes"] == len(b'{"n": 2}\n{"n": 3}\n') and not everything["has_more"]
    pages, after = [], None
    while True:  # one at a time, each page continuing after the last
        page = listed(limit=1, **({"after": after} if after else {}))
        pages += [f["id"] for f in page["data"]]
        if not page["has_more"]:
            break
        after = page["last_id"]
    assert pages == ids
    assert [f["id"] for f in listed(order="asc")["data"]] == [
        output_file_id(first),
        error_file_id(first),
        output_file_id(last),
    ]
    assert [f["id"] for f in listed(after=output_file_id(first))["data"]] == [error_file_id(first)]
    uploads = api.client.get("/v1/files", headers=api.auth(), params={"purpose": "batch"}).json()["data"]
    assert all(f["purpose"] == "batch" for f in uploads) and len(uploads) == 3
    other = api.client.get("/v1/files", headers=api.auth("globex"), params={"purpose": "batch_output"})
    assert other.json()["data"] == []  # another tenant's results do not exist for it
    bad = api.client.get(
        "/v1/files", headers=api.auth(), params={"purpose": "batch_output", "after": file_id}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "after"


def test_without_a_purpose_every_file_is_listed_uploads_first_then_results_in_pages() -> None:
    """As OpenAI's ``GET /v1/files``: every file of the tenant (before, the uploads only)."""
    api = make_api()
    first = _finished_batch(api, [b'{"n": 1}\n'], [b'{"e": 1}\n'])
    api.clock.now += 10
    last = _finished_batch(api, [b'{"n": 2}\n'], [])

    def listed(**params: Any) -> dict[str, Any]:
        answer = api.client.get("/v1/files", headers=api.auth(), params=params)
        assert answer.status_code == 200, answer.text
        return dict(answer.json())

    uploads = [f["id"] for f in listed(purpose="batch")["data"]]
    results = [f["id"] for f in listed(purpose="batch_output")["data"]]
    assert len(uploads) == 2
    assert results == [output_file_id(last), output_file_id(first), error_file_id(first)]
    everything = listed()
    assert [f["id"] for f in everything["data"]] == uploads + results and not everything["has_more"]
    for size in (1, 2, 3, 5):  # pages of every size meet the uploads/results seam without a gap or a repeat
        pages, after = [], None
        while True:
            page = listed(limit=size, **({"after": after} if after else {}))
            pages += [f["id"] for f in page["data"]]
            if not page["has_more"]:
                break
            after = page["last_id"]
        assert pages == uploads + results, size
    assert [f["id"] for f in listed(limit=2)["data"]] == uploads and listed(limit=2)["has_more"]


def test_a_tenant_may_have_a_storage_quota_of_its_own() -> None:
    data = jsonl(chat_line("a"), chat_line("b"))
    api = make_api(storage_limits={"*": len(data) + 10, "globex": 3 * len(data) + 10})
    upload_ok(api, data)
    assert api.upload(data).status_code == 429  # acme: the default
    for _ in range(3):
        upload_ok(api, data, tenant="globex")  # globex: its own, larger
    refused = api.upload(data, tenant="globex")
    assert (
        refused.status_code == 429
        and f"quota of {3 * len(data) + 10} bytes" in refused.json()["error"]["message"]
    )
