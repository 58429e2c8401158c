"""`make demo`'s batch file: cut to N valid prompts, invalid lines kept, numbered as the job sees them."""

from __future__ import annotations

from pathlib import Path

import orjson
import pytest

from llmbatch.demo.batch import MODEL, prepare_batch
from llmbatch.demo.run import DATA_FILE

pytestmark = pytest.mark.unit


def _chat(custom_id: str, question: str) -> bytes:
    body = {
        "model": MODEL,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": question}],
        "max_tokens": 8,
    }
    line = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}
    return orjson.dumps(line)


def _write(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "in.jsonl"
    path.write_bytes(b"\n".join(lines))  # no newline after the last line: the demo adds it
    return path


def test_the_shipped_sample_has_thirty_prompts_and_two_invalid_lines(tmp_path: Path) -> None:
    batch = prepare_batch(DATA_FILE, None, tmp_path)
    assert (len(batch.prompts), len(batch.invalid)) == (30, 2)
    assert batch.total_lines == 32 == len(batch.path.read_bytes().splitlines())


def test_cut_keeps_the_first_valid_prompts_and_every_invalid_line(tmp_path: Path) -> None:
    wrong_method = b'{"custom_id": "d", "method": "GET", "url": "/v1/chat/completions", "body": {}}'
    source = _write(
        tmp_path, [_chat("a", "one?"), b"{not json", _chat("b", "two?"), _chat("c", "three?"), wrong_method]
    )
    work = tmp_path / "work"
    work.mkdir()
    batch = prepare_batch(source, 2, work)
    assert batch.prompts == {"a": "one?", "b": "two?"}  # the last user message, not the system one
    sent = batch.path.read_bytes()
    assert sent.endswith(b"\n") and sent.count(b"\n") == 4  # a, bad, b, d: c was cut
    assert b'"c"' not in sent
    # numbered in the file as sent (the job's numbering), not the source's
    assert [problem.split(":")[0] for problem in batch.invalid] == ["line 2", "line 4"]


def test_all_prompts_when_no_cut(tmp_path: Path) -> None:
    source = _write(tmp_path, [_chat(f"id-{n}", f"q{n}") for n in range(5)])
    batch = prepare_batch(source, None, tmp_path)
    assert list(batch.prompts) == [f"id-{n}" for n in range(5)] and batch.invalid == []
