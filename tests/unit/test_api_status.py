"""The pure mapping from llmbatch's batch state to OpenAI's Batch object (api.status).

Redis hashes are written by the dispatcher's own field builders (tests/support/api_fakes.py), read
through the operator CLI's detail_of, and every Batch is validated with the openai SDK's model."""

from __future__ import annotations

from typing import Any

import openai.types
import pytest

from llmbatch.api.batches.status import error_file_id, openai_status, output_file_id, to_batch
from llmbatch.api.objects import Batch
from llmbatch.api.store.records import BATCH_PREFIX, StoredBatch, new_id
from llmbatch.dispatcher.domain.events import Outcome
from llmbatch.dispatcher.domain.states import State
from llmbatch.dispatcher.ops.jobs import detail_of
from llmbatch.schemas import BatchRequest, Envelope, Manifest, encode
from tests.support.api_fakes import MemoryDispatcher

pytestmark = pytest.mark.unit

T0 = 1_780_000_000.0
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RESULTS = "s3://llmbatch-results/acme"


def stored(**changes: Any) -> StoredBatch:
    batch_id = new_id(BATCH_PREFIX, T0)
    base = StoredBatch(
        id=batch_id,
        tenant="acme",
        created_at=T0,
        input_file_id="file-0000000000001" + "0" * 16,
        endpoint="/v1/chat/completions",
        model=MODEL,
        completion_window="24h",
        expires_at=T0 + 86400,
        metadata={"team": "search"},
        total=5,
        input_uri=f"s3://llmbatch-input/acme/files/{batch_id}.jsonl",
    )
    return base.model_copy(update=changes)


def accepted(batch: StoredBatch, dispatcher: MemoryDispatcher, at: float) -> None:
    request = BatchRequest(
        batch_id=batch.id,
        model=batch.model,
        endpoint=batch.endpoint,
        input_uri=batch.input_uri,
        completion_window=batch.completion_window,
        metadata=batch.metadata,
        tenant=batch.tenant,
    )
    key, value, headers = encode(Envelope.new(request, source="urn:test"))
    dispatcher.take_in(("llm.batch.requests.v1", key, value, headers), at)


def view(batch: StoredBatch, dispatcher: MemoryDispatcher | None, **kwargs: Any) -> Batch:
    job = None
    if dispatcher is not None and batch.id in dispatcher.hashes:
        job = detail_of(dispatcher.record(batch.id), dispatcher.progress.get(batch.id, {}))
    result = to_batch(batch, job, **kwargs)
    # the official SDK parses it
    sdk = openai.types.Batch.model_validate(result.model_dump(mode="json"))
    assert sdk.id == batch.id and sdk.status == result.status
    return result


def shards(batch: StoredBatch, kind: str, n: int) -> list[str]:
    return [f"{RESULTS}/{batch.id}/l1/{kind}-a1-{i:05d}.jsonl" for i in range(n)]


@pytest.mark.parametrize(
    ("state", "cancel", "expected"),
    [
        (None, False, "validating"),
        (None, True, "cancelling"),
        (State.ACCEPTED, False, "in_progress"),
        (State.QUEUED, False, "in_progress"),
        (State.SUBMITTED, False, "in_progress"),
        (State.RUNNING, False, "in_progress"),
        (State.RUNNING, True, "cancelling"),
        (State.QUEUED, True, "cancelling"),
        (State.FINALIZING, False, "finalizing"),
        (State.FINALIZING, True, "cancelling"),
        (State.COMPLETED, False, "completed"),
        (State.COMPLETED, True, "completed"),
        (State.FAILED, False, "failed"),
        (State.DEAD_LETTERED, False, "failed"),
        (State.EXPIRED, False, "expired"),
        (State.CANCELLED, False, "cancelled"),
        (State.CANCELLED, True, "cancelled"),
    ],
)
def test_every_state_has_its_openai_status(state: State | None, cancel: bool, expected: str) -> None:
    assert openai_status(state, cancel_requested=cancel) == expected


def test_every_dispatcher_state_is_mapped() -> None:
    statuses = {openai_status(s, cancel_requested=False) for s in State}
    assert statuses == {"in_progress", "finalizing", "completed", "failed", "expired", "cancelled"}


def test_a_batch_not_yet_taken_in_is_validating_with_the_file_count() -> None:
    batch = view(stored(), MemoryDispatcher())
    assert batch.status == "validating"
    assert batch.request_counts.total == 5 and batch.request_counts.completed == 0
    assert batch.created_at == int(T0) and batch.expires_at == int(T0) + 86400
    assert batch.in_progress_at is None and batch.output_file_id is None and batch.errors is None
    assert batch.model == MODEL and batch.metadata == {"team": "search"}


def test_a_completed_batch_walks_through_every_status_with_its_timestamps() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    accepted(record, dispatcher, T0 + 2)
    batch = view(record, dispatcher)
    assert batch.status == "in_progress" and batch.in_progress_at == int(T0 + 2)
    assert batch.expires_at == int(T0 + 2 + 86400)  # the dispatcher's deadline, from acceptance

    dispatcher.run(record.id, T0 + 10, total=5, completed=2, failed=1, prompt_tokens=30, completion_tokens=12)
    batch = view(record, dispatcher)
    assert batch.status == "in_progress"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (5, 2, 1)
    assert batch.usage is not None and (batch.usage.input_tokens, batch.usage.output_tokens) == (30, 12)
    assert batch.usage.total_tokens == 42

    dispatcher.finalize(record.id, T0 + 20)
    batch = view(record, dispatcher)
    assert batch.status == "finalizing" and batch.finalizing_at == int(T0 + 20)
    assert batch.output_file_id is None  # not before the batch ended

    dispatcher.finish(
        record.id,
        Outcome(
            State.COMPLETED,
            T0 + 25,
            shards(record, "output", 2),
            shards(record, "error", 1),
            f"{RESULTS}/{record.id}/l1/manifest.json",
            {"total": 5, "completed": 4, "failed": 1},
            {"prompt_tokens": 50, "completion_tokens": 20},
            T0 + 10,
        ),
    )
    batch = view(record, dispatcher)
    assert batch.status == "completed" and batch.completed_at == int(T0 + 25)
    assert batch.finalizing_at == int(T0 + 20) and batch.in_progress_at == int(T0 + 2)
    assert batch.failed_at is None and batch.cancelled_at is None and batch.errors is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (4, 1)
    assert batch.usage is not None and batch.usage.total_tokens == 70
    assert batch.output_file_id == output_file_id(record.id)
    assert batch.error_file_id == error_file_id(record.id)


def test_a_completed_batch_without_error_lines_has_no_error_file() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    accepted(record, dispatcher, T0 + 1)
    dispatcher.run(record.id, T0 + 2)
    dispatcher.finalize(record.id, T0 + 3)
    dispatcher.finish(
        record.id,
        Outcome(
            State.COMPLETED,
            T0 + 4,
            shards(record, "output", 1),
            [],
            counts={"total": 5, "completed": 5, "failed": 0},
        ),
    )
    batch = view(record, dispatcher)
    assert batch.output_file_id is not None and batch.error_file_id is None


def test_a_failed_batch_says_why() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    accepted(record, dispatcher, T0 + 1)
    dispatcher.run(record.id, T0 + 2)
    dispatcher.finish(
        record.id,
        Outcome(
            State.FAILED,
            T0 + 9,
            error_code="attempts_exhausted",
            error_message="3 attempts failed",
            dlt_reason="attempts_exhausted",
        ),
    )
    batch = view(record, dispatcher)
    assert batch.status == "failed" and batch.failed_at == int(T0 + 9) and batch.completed_at is None
    assert batch.errors is not None and len(batch.errors.data) == 1
    assert batch.errors.data[0].code == "attempts_exhausted"
    assert batch.errors.data[0].message == "3 attempts failed"
    assert batch.output_file_id is None


def test_a_request_rejected_at_intake_is_failed_with_the_reason() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    dispatcher.reject(record.id, T0 + 1, "model_not_found", "unknown model")
    batch = view(record, dispatcher)
    assert batch.status == "failed" and batch.failed_at == int(T0 + 1)
    assert batch.in_progress_at is None
    assert batch.errors is not None and batch.errors.data[0].code == "model_not_found"


def test_errors_of_an_earlier_attempt_do_not_show_while_the_batch_runs() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    accepted(record, dispatcher, T0 + 1)
    dispatcher.run(record.id, T0 + 2)
    dispatcher.hashes[record.id].update(last_error_code="job_lost", last_error_message="retrying")
    batch = view(record, dispatcher)
    assert batch.status == "in_progress" and batch.errors is None


def test_a_cancel_asked_through_the_api_reads_cancelling_before_the_dispatcher_sees_it() -> None:
    record = stored(cancel_requested_at=T0 + 5)
    batch = view(record, MemoryDispatcher())
    assert batch.status == "cancelling" and batch.cancelling_at == int(T0 + 5)

    dispatcher = MemoryDispatcher()
    accepted(record, dispatcher, T0 + 1)
    dispatcher.run(record.id, T0 + 2)
    batch = view(record, dispatcher)
    assert batch.status == "cancelling" and batch.cancelling_at == int(T0 + 5)


def test_a_cancel_recorded_by_the_dispatcher_reads_cancelling_then_cancelled() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    accepted(record, dispatcher, T0 + 1)
    dispatcher.run(record.id, T0 + 2, total=5, completed=2)
    dispatcher.ask_cancel(record.id, T0 + 3)
    batch = view(record, dispatcher)
    assert batch.status == "cancelling" and batch.cancelling_at == int(T0 + 3)

    dispatcher.finish(
        record.id,
        Outcome(
            State.CANCELLED,
            T0 + 7,
            shards(record, "output", 1),
            [],
            counts={"total": 5, "completed": 2, "failed": 0},
        ),
    )
    batch = view(record, dispatcher)
    assert batch.status == "cancelled" and batch.cancelled_at == int(T0 + 7)
    assert batch.cancelling_at == int(T0 + 3)
    assert batch.output_file_id == output_file_id(record.id)  # partial results are kept
    assert batch.request_counts.completed == 2 and batch.request_counts.total == 5


def test_an_expired_batch_keeps_its_partial_results() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    accepted(record, dispatcher, T0 + 1)
    dispatcher.run(record.id, T0 + 2)
    dispatcher.finish(
        record.id,
        Outcome(
            State.EXPIRED,
            T0 + 99,
            shards(record, "output", 1),
            shards(record, "error", 1),
            counts={"total": 5, "completed": 3},
        ),
    )
    batch = view(record, dispatcher)
    assert batch.status == "expired" and batch.expired_at == int(T0 + 99)
    assert batch.output_file_id is not None and batch.error_file_id is not None


def _manifest(record: StoredBatch, status: str, **extra: Any) -> Manifest:
    return Manifest.model_validate(
        {
            "batch_id": record.id,
            "attempt": 1,
            "status": status,
            "request_counts": {"total": 5, "completed": 4, "failed": 1},
            "usage": {"prompt_tokens": 9, "completion_tokens": 3},
            "output_shards": [{"uri": u, "lines": 4} for u in shards(record, "output", 1)],
            "error_shards": [{"uri": u, "lines": 1} for u in shards(record, "error", 1)],
            "timings": {"started_at": "2026-05-28T20:00:00Z", "finished_at": "2026-05-28T20:10:00Z"},
            **extra,
        }
    )


def test_without_redis_the_manifest_says_how_the_batch_ended() -> None:
    record = stored()
    batch = view(record, None, manifest=_manifest(record, "completed"))
    assert batch.status == "completed" and batch.completed_at is not None
    assert batch.request_counts.completed == 4 and batch.usage is not None and batch.usage.total_tokens == 12
    assert batch.output_file_id == output_file_id(record.id)
    assert batch.error_file_id == error_file_id(record.id)

    partial = view(record, None, manifest=_manifest(record, "partial"))
    assert partial.status == "failed" and partial.errors is not None and partial.failed_at is not None


def test_a_manifest_of_another_batch_is_ignored() -> None:
    record, other = stored(), stored(id=new_id(BATCH_PREFIX, T0 + 1))
    assert view(record, None, manifest=_manifest(other, "completed")).status == "validating"


def test_state_of_another_tenant_is_never_shown() -> None:
    record, dispatcher = stored(), MemoryDispatcher()
    accepted(record.model_copy(update={"tenant": "other"}), dispatcher, T0 + 1)
    assert dispatcher.hashes[record.id]["tenant"] == "other"
    assert view(record, dispatcher).status == "validating"
