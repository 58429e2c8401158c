"""Input stage: one Ray task streams the input (S3 object or inline lines) and yields row blocks.

A single task reads the file front to back, so line numbers and duplicate detection are exact;
it streams the object in 1 MiB chunks and yields a block every ``block_rows`` rows, so neither
it nor the driver ever holds the whole file, and Ray Data's backpressure paces it. Lines finished
by earlier attempts are skipped here: the :class:`Source` names the shards the driver's resume scan
took, and the task reads their keys back into a :class:`~llmbatch.ray_job.lines.parse.DoneKeys` of its own
(bounded memory; a set of a million keys would otherwise be pickled from the driver to the task).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pyarrow as pa
from pyarrow import fs as pafs

from llmbatch.ray_job.job import resume
from llmbatch.ray_job.lines import rows
from llmbatch.ray_job.lines.parse import DoneKeys, parse_lines
from llmbatch.ray_job.storage import s3
from llmbatch.schemas.common import Endpoint
from llmbatch.schemas.job import S3Session
from llmbatch.schemas.lines import split_lines


@dataclass(frozen=True, slots=True)
class Source:
    """What the reader task reads and how it validates it."""

    batch_id: str
    endpoint: str
    model: str
    input_path: str | None = None
    inline: bytes | None = None
    done_shards: tuple[str, ...] = ()
    """Shards whose lines earlier attempts answered (:attr:`llmbatch.ray_job.job.resume.Prior.done_shards`),
    skipped."""
    block_rows: int = 64
    max_line_bytes: int | None = None
    session: S3Session | None = None
    """The attempt's own S3 keys (:mod:`llmbatch.ray_job.storage.s3_session`); ``None``: the process's."""


def iter_blocks(source: Source, fs: pafs.FileSystem | None = None) -> Iterator[list[rows.Row]]:
    """Row blocks of the input, bad lines as error rows, finished lines skipped."""
    if fs is None and (source.input_path is not None or source.done_shards):
        fs = s3.filesystem(source.session)
    if source.input_path is not None:
        assert fs is not None
        chunks: Iterator[bytes] = s3.read_chunks(fs, source.input_path)
    else:
        chunks = iter([source.inline or b""])
    done = resume.done_keys(fs, source.done_shards) if fs is not None and source.done_shards else DoneKeys()
    try:
        block: list[rows.Row] = []
        parsed = parse_lines(
            split_lines(chunks, source.max_line_bytes),
            batch_id=source.batch_id,
            endpoint=Endpoint(source.endpoint),
            model=source.model,
            done=done,
            max_line_bytes=source.max_line_bytes,
        )
        for row in parsed:
            block.append(row)
            if len(block) >= source.block_rows:
                yield block
                block = []
        if block:
            yield block
    finally:
        done.close()


def read_rows(batch: pa.Table, *, source: Source) -> Iterator[pa.Table]:
    """Ray Data UDF (``map_batches`` over a one-row dataset): yields the input as row tables."""
    del batch
    produced = False
    for block in iter_blocks(source):
        produced = True
        yield rows.to_table(block)
    if not produced:
        yield rows.to_table([])
