"""Reading a finished batch's results from S3: its manifest, and its output and error lines shard by
shard (:class:`~llmbatch.producer.client.BatchClient` reads through one of these)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from pydantic import BaseModel, ValidationError

from llmbatch.adapters import storage
from llmbatch.adapters.errors import ProducerError, ResultsNotFound, StorageError
from llmbatch.schemas import (
    BatchOutputLine,
    Envelope,
    Manifest,
    SchemaError,
    TerminalEventData,
    output_prefix,
    parse_manifest,
)
from llmbatch.schemas.job import MANIFEST_NAME
from llmbatch.settings import S3Settings

ResultSource = Envelope[Any] | TerminalEventData | Manifest | Sequence[str]
"""Where results are named: a terminal event (or its data), a manifest, or shard URIs."""


class ResultReader:
    """A batch's results on ``s3`` (a ``minio.Minio`` client) of the deployment ``s3_settings`` names."""

    def __init__(self, s3: Any, s3_settings: S3Settings) -> None:
        self.s3 = s3
        self.s3_settings = s3_settings

    async def manifest(self, batch_id: str, *, tenant: str = "default") -> Manifest:
        """Read ``manifest.json`` of a finished batch from the results bucket (of its latest
        lifecycle, when the batch id was used again after its record expired; the terminal event's
        ``manifest_uri`` names the one of that lifecycle).

        Raises:
            ResultsNotFound: no manifest yet (the batch is unknown or still running).
        """
        folder = output_prefix(self.s3_settings.results_bucket, tenant, batch_id)
        found = await asyncio.to_thread(
            storage.latest_manifest, self.s3, self.s3_settings, folder, MANIFEST_NAME
        )
        if found is None:
            raise ResultsNotFound(f"no results for batch {batch_id!r} yet (no manifest under {folder})")
        uri = found
        try:
            raw = await asyncio.to_thread(storage.get_bytes, self.s3, self.s3_settings, uri)
        except StorageError as exc:
            if "not found" in exc.message:
                raise ResultsNotFound(
                    f"no results for batch {batch_id!r} yet ({uri} does not exist)"
                ) from None
            raise
        try:
            return parse_manifest(raw)
        except SchemaError as exc:
            raise ProducerError(f"{uri} is not a valid manifest: {exc}") from None

    async def iter_results(
        self, source: ResultSource, *, errors: bool = False
    ) -> AsyncIterator[BatchOutputLine]:
        """Yield the output lines (or, with ``errors``, the error lines) of a finished batch.

        ``source`` is a terminal event (or its data), a :class:`Manifest`, or a list of shard URIs.
        Shards are read one at a time.
        """
        for uri in result_uris(source, errors=errors):
            raw_lines = await asyncio.to_thread(self._read_lines, uri)
            for number, raw in enumerate(raw_lines, start=1):
                try:
                    yield BatchOutputLine.model_validate_json(raw)
                except ValidationError as exc:
                    raise ProducerError(
                        f"{uri} line {number}: {SchemaError.from_validation_error(exc)}"
                    ) from None

    def _read_lines(self, uri: str) -> list[bytes]:
        return list(storage.iter_lines(self.s3, self.s3_settings, uri))


def result_uris(source: ResultSource, *, errors: bool) -> list[str]:
    """The output (or, with ``errors``, error) shard URIs ``source`` names."""
    found: Any = source.data if isinstance(source, Envelope) else source
    if isinstance(found, TerminalEventData | Manifest):
        return list(found.error_uris if errors else found.output_uris)
    if isinstance(found, str):
        return [found]
    if isinstance(found, BaseModel):
        raise ProducerError(f"{type(found).__name__} carries no result files; pass a terminal event")
    return [str(uri) for uri in found]
