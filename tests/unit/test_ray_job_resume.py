"""ray_job resume, shard writing and manifest logic, on a local pyarrow filesystem (no S3)."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import orjson
import pytest
from pyarrow import fs as pafs

from llmbatch.ray_job.errors import RequestFailure, SupersededError
from llmbatch.ray_job.job import manifest, resume
from llmbatch.ray_job.job.writer import ShardWriter
from llmbatch.ray_job.lines.formatting import error_line, output_line
from llmbatch.ray_job.lines.parse import DoneKeys
from llmbatch.ray_job.lines.records import Generation
from llmbatch.ray_job.lines.rows import SeenLines
from llmbatch.schemas.common import BatchStatus, Endpoint
from llmbatch.schemas.job import AttemptRecord, Manifest, Timings, parse_manifest
from llmbatch.schemas.openai import ErrorObject, Usage

pytestmark = pytest.mark.unit
NOW = datetime(2026, 1, 1, tzinfo=UTC)


def out_line(cid: str, line_no: int, p: int = 5, c: int = 2) -> bytes:
    return output_line(
        Endpoint.CHAT_COMPLETIONS,
        Generation(str(line_no), "t", "stop", p, c),
        batch_id="b",
        custom_id=cid,
        line_no=line_no,
        model="m",
        created=1,
    )


def err_line(cid: str, line_no: int) -> bytes:
    return error_line(RequestFailure("invalid_value", "x"), batch_id="b", custom_id=cid, line_no=line_no)


def done_set(keys: DoneKeys, custom_ids: list[str], lines: range) -> tuple[set[str], set[int]]:
    """Which of ``custom_ids`` and ``lines`` the keys say are done."""
    return {c for c in custom_ids if keys.has_custom_id(c)}, {n for n in lines if keys.has_line(n)}


@pytest.fixture
def local(tmp_path: Path) -> pafs.FileSystem:
    (tmp_path / "bkt" / "t" / "b").mkdir(parents=True)
    return pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())


def test_shard_names() -> None:
    assert resume.parse_shard_name("output-a2-00003.jsonl") == ("output", 2, 3)
    assert resume.parse_shard_name("error-a10-123456.jsonl") == ("error", 10, 123456)
    for other in ("manifest.json", "output-00001.jsonl", "output-a1-1.jsonl", "errors-a1-00000.jsonl"):
        assert resume.parse_shard_name(other) is None


def test_done_keys_from_shard_lines(local: pafs.FileSystem) -> None:
    out = ShardWriter(local, "bkt/t/b/", "output", 1)
    for raw in (out_line("a", 1), out_line("b", 2), b"garbage\n", b"  \n"):
        out.add(raw)
    out.flush()
    err = ShardWriter(local, "bkt/t/b/", "error", 1)
    for raw in (err_line("@line-3", 3), err_line("a", 4), b"{}\n"):
        err.add(raw)
    err.flush()
    prior = resume.scan(local, "bkt/t/b/")
    assert prior.done_shards == ("bkt/t/b/error-a1-00000.jsonl", "bkt/t/b/output-a1-00000.jsonl")
    done = resume.done_keys(local, prior.done_shards)
    assert [done.has_custom_id(c) for c in ("a", "b", "@line-3", "garbage")] == [True, True, False, False]
    assert [done.has_line(n) for n in (3, 4, 1, 2)] == [True, True, False, False]  # output lines: by id
    assert len(done) == 4


def test_writer_rolls_by_lines_bytes_and_age_and_never_reuses_names(local: pafs.FileSystem) -> None:
    clock = [0.0]
    w = ShardWriter(
        local,
        "bkt/t/b/",
        "output",
        2,
        start_index=3,
        max_lines=3,
        max_bytes=10_000,
        max_seconds=60,
        clock=lambda: clock[0],
    )
    for i in range(7):
        w.add(out_line(f"r{i}", i + 1), 5, 2)
    assert [s.lines for s in w.shards] == [3, 3] and w.buffered_lines == 1
    clock[0] = 30.0
    w.roll_if_old()
    assert len(w.shards) == 2
    clock[0] = 61.0
    w.roll_if_old()
    assert [s.lines for s in w.shards] == [3, 3, 1]
    assert w.flush() is None  # nothing open
    assert [s.uri.rsplit("/", 1)[1] for s in w.shards] == [
        "output-a2-00003.jsonl",
        "output-a2-00004.jsonl",
        "output-a2-00005.jsonl",
    ]
    assert (w.prompt_tokens, w.completion_tokens) == (35, 14)
    big = ShardWriter(local, "bkt/t/b", "error", 2, max_lines=1000, max_bytes=1024)
    for i in range(10):
        big.add(err_line(f"e{i}", i))
    assert big.shards and all((s.size_bytes or 0) >= 1024 for s in big.shards)


def test_scan_counts_prior_shards_and_next_index(local: pafs.FileSystem) -> None:
    w1 = ShardWriter(local, "bkt/t/b/", "output", 1, max_lines=2)
    for i in range(3):
        w1.add(out_line(f"r{i}", i + 1, p=10, c=3))
    w1.flush()
    e1 = ShardWriter(local, "bkt/t/b/", "error", 1)
    e1.add(err_line("@line-9", 9))
    e1.flush()
    with local.open_output_stream("bkt/t/b/manifest.json") as f:
        f.write(b"{}")
    prior = resume.scan(local, "bkt/t/b/")
    assert [(s.kind, s.attempt, s.index, s.lines) for s in prior.shards] == [
        ("error", 1, 0, 1),
        ("output", 1, 0, 2),
        ("output", 1, 1, 1),
    ]
    assert (prior.completed, prior.failed, prior.prompt_tokens, prior.completion_tokens) == (3, 1, 30, 9)
    assert prior.next_index("output", 1) == 2 and prior.next_index("output", 2) == 0
    assert prior.per_attempt() == {1: (3, 1)}
    keys = resume.done_keys(local, prior.done_shards)  # what the reader task skips
    assert done_set(keys, ["r0", "r1", "r2", "r3"], range(1, 12)) == ({"r0", "r1", "r2"}, {9})


def test_history_adds_lost_attempts_and_replaces_the_current_one(local: pafs.FileSystem) -> None:
    w = ShardWriter(local, "bkt/t/b/", "output", 2)
    w.add(out_line("x", 1))
    w.flush()
    prior = resume.scan(local, "bkt/t/b/")
    previous = Manifest(
        batch_id="b",
        attempt=1,
        status="partial",
        timings=Timings(started_at=NOW, finished_at=NOW),
        attempts=[AttemptRecord(attempt=1, submission_id="b-a1", status="partial", completed=0, failed=0)],
    )
    current = AttemptRecord(attempt=3, submission_id="b-a3", status=BatchStatus.COMPLETED, completed=4)
    records = manifest.history("b", previous, prior, current)
    assert [(r.attempt, r.status) for r in records] == [
        (1, "partial"),
        (2, BatchStatus.FAILED),
        (3, "completed"),
    ]
    assert records[1].completed == 1 and records[1].error is not None


def test_build_manifest_counts_and_round_trip() -> None:
    shards = [
        resume.Shard("output", 1, 0, "bkt/t/b/output-a1-00000.jsonl", 10, lines=5).info(),
        resume.Shard("error", 2, 0, "bkt/t/b/error-a2-00000.jsonl", 10, lines=2).info(),
        resume.Shard("output", 2, 0, "bkt/t/b/output-a2-00000.jsonl", 10, lines=3).info(),
    ]
    built = manifest.build(
        batch_id="b",
        attempt=2,
        status="completed",
        total=None,
        shards=shards,
        usage=Usage(prompt_tokens=3, completion_tokens=4),
        attempts=[],
        started_at=NOW,
        finished_at=NOW,
        engine_start_s=1.5,
        generation_s=2.0,
    )
    assert built.request_counts.model_dump() == {"total": 10, "completed": 8, "failed": 2}
    again = parse_manifest(built.to_json())
    assert again.output_uris == ["s3://bkt/t/b/output-a1-00000.jsonl", "s3://bkt/t/b/output-a2-00000.jsonl"]
    assert again.error_uris == ["s3://bkt/t/b/error-a2-00000.jsonl"]
    assert orjson.loads(built.to_json())["output_uris"] == again.output_uris  # in the JSON too
    partial = manifest.build(
        batch_id="b",
        attempt=2,
        status="partial",
        total=40,
        shards=shards,
        usage=Usage(),
        attempts=[],
        started_at=NOW,
        finished_at=NOW,
        engine_start_s=None,
        generation_s=None,
        error=ErrorObject(code="stopped", message="SIGTERM"),
    )
    assert partial.status == "partial" and partial.request_counts.total == 40


def test_seen_lines_bitmap() -> None:
    seen = SeenLines()
    assert seen.add(1) and seen.add(100_000) and seen.add(0)
    assert not seen.add(1) and not seen.add(100_000)
    assert seen.add(2)


def test_scan_leaves_out_a_stale_attempts_shard_answering_requests_again(local: pafs.FileSystem) -> None:
    # attempt 2 resumed from attempt 1's first shard, then attempt 1 (not stopped: a zombie) went on
    # and put a shard answering r2 and r3, which attempt 2 also answered
    a1 = ShardWriter(local, "bkt/t/b/", "output", 1, max_lines=2)
    for i in range(4):
        a1.add(out_line(f"r{i}", i + 1))
    a2 = ShardWriter(local, "bkt/t/b/", "output", 2)
    a2.add(out_line("r2", 3))
    a2.add(out_line("r3", 4))
    a2.add(out_line("r4", 5))
    a2.flush()
    e1 = ShardWriter(local, "bkt/t/b/", "error", 1)
    e1.add(err_line("@line-9", 9))
    e1.flush()
    e2 = ShardWriter(local, "bkt/t/b/", "error", 2)
    e2.add(err_line("@line-9", 9))
    e2.add(err_line("r5", 6))  # a duplicate custom_id's error line shares an output's custom_id: no clash
    e2.flush()
    prior = resume.scan(local, "bkt/t/b/")
    assert [(s.kind, s.attempt, s.index) for s in prior.shards] == [
        ("error", 1, 0),
        ("output", 1, 0),
        ("output", 1, 1),
    ]
    assert [(s.kind, s.attempt, s.index) for s in prior.skipped] == [("error", 2, 0), ("output", 2, 0)]
    assert (prior.completed, prior.failed) == (4, 1)  # each request once: r0-r3, line 9
    keys = resume.done_keys(local, prior.done_shards)  # what the reader task skips
    assert done_set(keys, [f"r{i}" for i in range(6)], range(1, 12)) == ({"r0", "r1", "r2", "r3"}, {9})
    # r4 and line 6 run again
    assert prior.next_index("output", 2) == 1  # a left-out shard is never overwritten


def test_a_writer_whose_fence_says_stale_puts_nothing(local: pafs.FileSystem) -> None:
    current = [True]
    w = ShardWriter(local, "bkt/t/b/", "output", 1, max_lines=1, fence=lambda: current[0])
    w.add(out_line("r0", 1))
    current[0] = False
    with pytest.raises(SupersededError):
        w.add(out_line("r1", 2))
    assert [s.lines for s in resume.scan(local, "bkt/t/b/").shards] == [1]
