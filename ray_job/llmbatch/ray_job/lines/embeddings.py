"""Embedding lines on the engine: one line of ``/v1/embeddings`` carries 1-2048 inputs, each one engine
request; the line succeeds when every input does, and its output line lists the vectors in order.

Pure bookkeeping between the engine stage (:mod:`llmbatch.ray_job.job.engine`) and the output format
(:func:`llmbatch.ray_job.lines.formatting.embedding_output_line`); the engine itself sees plain requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from llmbatch.ray_job.errors import RequestFailure
from llmbatch.ray_job.lines.records import Generation, GenRequest

_INPUT_SEP = "."


@dataclass(slots=True)
class EmbeddingLine:
    """One embedding line on its way through the engine: its requests, then their answers."""

    requests: list[GenRequest]
    encoding_format: str
    answers: dict[str, Generation] = field(default_factory=dict)

    @classmethod
    def from_prompt(cls, key: str, prompt: dict[str, Any], custom_id: str) -> EmbeddingLine:
        """The requests of a prompt-stage payload (``inputs``, ``sampling``, ``encoding_format``);
        request keys are ``<key>.<input index>``."""
        sampling = prompt["sampling"]
        requests = [
            GenRequest(f"{key}{_INPUT_SEP}{index}", list(ids), dict(sampling), custom_id=custom_id)
            for index, ids in enumerate(prompt["inputs"])
        ]
        return cls(requests, str(prompt.get("encoding_format") or "float"))

    def take(self, gen: Generation) -> None:
        """Record the answer to one of this line's requests."""
        self.answers[gen.key] = gen

    def failure(self) -> RequestFailure | None:
        """The first failed input's failure (the whole line fails with it), else ``None``."""
        for request in self.requests:
            answer = self.answers.get(request.key)
            if answer is not None and answer.failure is not None:
                return answer.failure
        return None

    def vectors(self) -> list[Generation]:
        """The answers in input order (call once every input has answered)."""
        return [self.answers[request.key] for request in self.requests]
