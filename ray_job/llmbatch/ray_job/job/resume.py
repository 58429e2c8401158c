"""Resume: what earlier attempts of the batch already finished, read back from their shards.

Shards are named per attempt (``output-a<N>-<i>.jsonl``, ``error-a<N>-<i>.jsonl``) and written
whole (one S3 put each), so every shard found under the output prefix is final: a crashed attempt
leaves complete shards or none. An attempt skips the input lines those shards already answer
(:class:`~llmbatch.ray_job.lines.parse.DoneKeys`, built by the reader task from :attr:`Prior.done_shards`) and
lists them in its manifest beside its own. Both the scan and the reader's keys stay bounded in memory
whatever the number of lines done (the keys spill to disk), so a shard is read twice on a resume:
once here for counts, once by the reader for its keys.

A stale attempt that kept running beside a later one (a stop that did not take) may still have put
shards answering requests the later attempt answered too. :func:`scan` takes shards in attempt order
and leaves out every shard answering a request an earlier-taken shard already answers (an output
custom_id, or an error's input line), so no request is counted twice and the lines of a left-out
shard are simply run again. Most such shards are never written: the attempt fence
(:meth:`llmbatch.ray_job.job.progress.Progress.still_current`) stops a stale attempt first.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

import orjson
from pyarrow import fs as pafs

from llmbatch.ray_job.lines.parse import DoneKeys
from llmbatch.ray_job.storage import s3
from llmbatch.schemas.job import ShardInfo
from llmbatch.schemas.lines import split_lines

log = logging.getLogger("ray_job.resume")
SHARD_RE = re.compile(r"^(output|error)-a(\d+)-(\d{5,})\.jsonl$")


@dataclass(slots=True)
class Shard:
    """One shard object of some attempt."""

    kind: str
    attempt: int
    index: int
    path: str
    size: int = 0
    lines: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def info(self) -> ShardInfo:
        return ShardInfo(
            uri=s3.uri_of(self.path), lines=self.lines, size_bytes=self.size, attempt=self.attempt
        )


@dataclass(slots=True)
class Prior:
    """Everything earlier attempts left: their shards (with counts) and totals."""

    shards: list[Shard] = field(default_factory=list)
    skipped: list[Shard] = field(default_factory=list)
    """Shards left out because an earlier shard answers some of their requests (a stale attempt's)."""

    @property
    def done_shards(self) -> tuple[str, ...]:
        """Paths of the taken shards: what the reader task skips (see :func:`done_keys`)."""
        return tuple(s.path for s in self.shards)

    @property
    def completed(self) -> int:
        return sum(s.lines for s in self.shards if s.kind == "output")

    @property
    def failed(self) -> int:
        return sum(s.lines for s in self.shards if s.kind == "error")

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.shards)

    @property
    def completion_tokens(self) -> int:
        return sum(s.completion_tokens for s in self.shards)

    def next_index(self, kind: str, attempt: int) -> int:
        """First free shard index of ``kind`` for ``attempt`` (never overwrite an existing shard)."""
        used = [s.index for s in self.shards + self.skipped if s.kind == kind and s.attempt == attempt]
        return max(used) + 1 if used else 0

    def per_attempt(self) -> dict[int, tuple[int, int]]:
        """attempt -> (completed, failed) lines it wrote."""
        out: dict[int, tuple[int, int]] = {}
        for shard in self.shards:
            done, failed = out.get(shard.attempt, (0, 0))
            if shard.kind == "output":
                done += shard.lines
            else:
                failed += shard.lines
            out[shard.attempt] = (done, failed)
        return out


def parse_shard_name(name: str) -> tuple[str, int, int] | None:
    """``output-a2-00003.jsonl`` -> ``("output", 2, 3)``; ``None`` for anything else."""
    match = SHARD_RE.fullmatch(name)
    if not match:
        return None
    return match.group(1), int(match.group(2)), int(match.group(3))


def list_shards(fs: pafs.FileSystem, prefix_path: str) -> list[Shard]:
    """Shards under the batch's output prefix, ordered by attempt, kind and index."""
    found = []
    for info in s3.list_objects(fs, prefix_path):
        parsed = parse_shard_name(info.base_name)
        if parsed:
            kind, attempt, index = parsed
            found.append(Shard(kind, attempt, index, info.path, int(info.size or 0)))
    return sorted(found, key=lambda s: (s.attempt, s.kind, s.index))


def line_keys(kind: str, raw: bytes) -> tuple[str | None, int | None, int, int]:
    """(custom_id, error line number, prompt tokens, completion tokens) of one shard line."""
    try:
        obj = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None, None, 0, 0
    if not isinstance(obj, dict):
        return None, None, 0, 0
    custom_id = obj.get("custom_id") if isinstance(obj.get("custom_id"), str) else None
    if kind == "error":
        error = obj.get("error") or {}
        line = error.get("line") if isinstance(error, dict) else None
        return custom_id, line if isinstance(line, int) else None, 0, 0
    usage = ((obj.get("response") or {}).get("body") or {}).get("usage") or {}
    return custom_id, None, int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)


@dataclass(slots=True)
class ShardKeys:
    """What one shard answers: its output custom_ids and its error lines' input line numbers."""

    custom_ids: list[str] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)


def summarize(fs: pafs.FileSystem, shard: Shard, answers: ShardKeys | None = None) -> Shard:
    """Count a shard's lines and tokens (streamed); collect what it answers into ``answers``."""
    lines = prompt = completion = 0
    for raw in split_lines(s3.read_chunks(fs, shard.path)):
        if not raw.strip():
            continue
        lines += 1
        custom_id, line, p, c = line_keys(shard.kind, raw)
        prompt += p
        completion += c
        if answers is not None:
            if shard.kind == "output" and custom_id is not None:
                answers.custom_ids.append(custom_id)
            elif shard.kind == "error" and line is not None:
                answers.lines.append(line)
    shard.lines, shard.prompt_tokens, shard.completion_tokens = lines, prompt, completion
    return shard


def scan(fs: pafs.FileSystem, prefix_path: str) -> Prior:
    """All shards under the prefix with their counts, but for those answering a request again."""
    prior = Prior()
    taken = DoneKeys()  # bounded: a shard's own keys are at most shard_max_lines
    try:
        for shard in list_shards(fs, prefix_path):
            answers = ShardKeys()
            summarize(fs, shard, answers)
            if any(map(taken.has_custom_id, answers.custom_ids)) or any(map(taken.has_line, answers.lines)):
                log.warning(
                    "shard %s answers requests an earlier shard answers: left out (a stale "
                    "attempt's); its other lines run again",
                    shard.path,
                )
                prior.skipped.append(shard)
                continue
            for custom_id in answers.custom_ids:
                taken.add_custom_id(custom_id)
            for line_no in answers.lines:
                taken.add_line(line_no)
            prior.shards.append(shard)
    finally:
        taken.close()
    return prior


def done_keys(fs: pafs.FileSystem, paths: Iterable[str]) -> DoneKeys:
    """What the shards at ``paths`` (:attr:`Prior.done_shards`) answer, read back streamed; the caller
    closes the result."""
    done = DoneKeys()
    try:
        for path in paths:
            parsed = parse_shard_name(path.rsplit("/", 1)[-1])
            if parsed is None:
                raise ValueError(f"{path}: not a shard name (output|error)-a<N>-<i>.jsonl")
            answers = ShardKeys()
            summarize(fs, Shard(parsed[0], parsed[1], parsed[2], path), answers)
            for custom_id in answers.custom_ids:
                done.add_custom_id(custom_id)
            for line_no in answers.lines:
                done.add_line(line_no)
    except BaseException:
        done.close()
        raise
    return done
