"""The reader task (ray_job.job.reader) over input files on a local pyarrow filesystem: compressed inputs
(.jsonl.gz, .jsonl.zst) are read as streams, by their extension, like plain ones."""

from __future__ import annotations

import gzip
from pathlib import Path

import orjson
import pyarrow as pa
import pytest
from pyarrow import fs as pafs

from llmbatch.ray_job.job.reader import Source, iter_blocks
from llmbatch.ray_job.lines import rows

pytestmark = pytest.mark.unit
CHAT = "/v1/chat/completions"


def jsonl(n: int) -> bytes:
    body = {"messages": [{"role": "user", "content": "hi"}]}
    lines = [
        orjson.dumps({"custom_id": f"r{i}", "method": "POST", "url": CHAT, "body": body}) for i in range(n)
    ]
    return b"\n".join([*lines, b"{broken"]) + b"\n"


@pytest.mark.parametrize("name", ["in.jsonl", "in.jsonl.gz", "in.jsonl.zst"])
def test_plain_and_compressed_inputs_give_the_same_rows(tmp_path: Path, name: str) -> None:
    data = jsonl(2000)
    path = tmp_path / name
    if name.endswith(".gz"):
        path.write_bytes(gzip.compress(data))
    elif name.endswith(".zst"):
        with pa.CompressedOutputStream(str(path), "zstd") as out:
            out.write(data)
    else:
        path.write_bytes(data)
    assert name == "in.jsonl" or path.stat().st_size < len(data) // 5  # really compressed
    source = Source(batch_id="b1", endpoint=CHAT, model="m", input_path=name, block_rows=500)
    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    blocks = list(iter_blocks(source, local))
    got = [row for block in blocks for row in block]
    assert len(blocks) == 5 and [len(b) for b in blocks[:4]] == [500] * 4  # streamed in blocks
    assert [r.custom_id for r in got[:2000]] == [f"r{i}" for i in range(2000)]
    assert all(r.kind == rows.REQUEST for r in got[:2000])
    assert (got[2000].line_no, got[2000].kind) == (2001, rows.INVALID)


def test_lines_earlier_attempts_answered_are_skipped(tmp_path: Path) -> None:
    """The driver's resume scan names the shards it took (Prior.done_shards); the task reads their keys
    back and skips the lines they answer."""
    from llmbatch.ray_job.errors import RequestFailure
    from llmbatch.ray_job.job import resume
    from llmbatch.ray_job.job.writer import ShardWriter
    from llmbatch.ray_job.lines.formatting import error_line, output_line
    from llmbatch.ray_job.lines.records import Generation
    from llmbatch.schemas.common import Endpoint

    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    local.create_dir("bkt/b")
    out = ShardWriter(local, "bkt/b/", "output", 1)
    out.add(
        output_line(
            Endpoint.CHAT_COMPLETIONS,
            Generation("2", "t", "stop", 1, 1),
            batch_id="b1",
            custom_id="r1",
            line_no=2,
            model="m",
            created=1,
        )
    )
    out.flush()
    err = ShardWriter(local, "bkt/b/", "error", 1)
    err.add(error_line(RequestFailure("invalid_json", "x"), batch_id="b1", custom_id="@line-4", line_no=4))
    err.flush()
    prior = resume.scan(local, "bkt/b/")
    source = Source(batch_id="b1", endpoint=CHAT, model="m", inline=jsonl(3), done_shards=prior.done_shards)
    got = [row for block in iter_blocks(source, fs=local) for row in block]
    assert [(r.line_no, r.custom_id) for r in got] == [(1, "r0"), (3, "r2")]  # r1 and bad line 4 done
    fresh = Source(batch_id="b1", endpoint=CHAT, model="m", inline=jsonl(3))
    assert [r.line_no for block in iter_blocks(fresh, fs=None) for r in block] == [1, 2, 3, 4]
