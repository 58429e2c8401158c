"""The demo's batch: the sample file cut to N valid prompts, its invalid lines kept on purpose.

Checked with the same validator the producer and the Ray job use (:func:`llmbatch.schemas.iter_input_lines`),
so the line numbers printed are the ones the job reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from llmbatch.stack.model import SERVED_MODEL

MODEL = SERVED_MODEL  # the name the local dispatcher serves the converted model under


@dataclass
class Batch:
    """The demo batch as prepared from the sample file."""

    path: Path
    prompts: dict[str, str]  # custom_id -> last user message, valid lines only
    invalid: list[str] = field(default_factory=list)  # "line N: why" per invalid line

    @property
    def total_lines(self) -> int:
        return len(self.prompts) + len(self.invalid)


def prepare_batch(source: Path, prompts: int | None, workdir: Path) -> Batch:
    """The sample file cut to ``prompts`` valid lines (invalid lines kept), checked with the same
    validator the producer and the Ray job use."""
    from llmbatch.schemas import Endpoint, iter_input_lines

    raw = source.read_bytes().splitlines(keepends=True)
    results = list(iter_input_lines(raw, endpoint=Endpoint.CHAT_COMPLETIONS, model=MODEL))
    kept: list[bytes] = []
    chosen: dict[str, str] = {}
    invalid: list[str] = []
    for result in results:
        line = raw[result.line_no - 1]
        if result.line is None:
            kept.append(line)
            continue
        if prompts is not None and len(chosen) >= prompts:
            continue
        messages = result.line.body.get("messages") or []
        users = [m.get("content", "") for m in messages if isinstance(m, dict) and m.get("role") == "user"]
        chosen[result.line.custom_id] = str(users[-1]) if users else ""
        kept.append(line)
    target = workdir / "demo-batch.jsonl"
    target.write_bytes(b"".join(line if line.endswith(b"\n") else line + b"\n" for line in kept))
    # line numbers as the job will report them: re-validate the file actually sent
    sent = target.read_bytes().splitlines(keepends=True)
    for result in iter_input_lines(sent, endpoint=Endpoint.CHAT_COMPLETIONS, model=MODEL):
        if result.error is not None:
            invalid.append(str(result.error))
    return Batch(target, chosen, invalid)
