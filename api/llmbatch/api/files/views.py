"""How the API's files answer: the :class:`~llmbatch.api.objects.FileObject` of an upload or of a batch's
result file, and the 404 of a file not found (``expired`` once the collector removed it or its batch)."""

from __future__ import annotations

from typing import Literal

from llmbatch.api.batches import results
from llmbatch.api.batches.expiry import Expiry
from llmbatch.api.batches.status import ERROR_PREFIX, OUTPUT_PREFIX
from llmbatch.api.errors import NotFound
from llmbatch.api.objects import FileObject
from llmbatch.api.store.records import StoredFile


def missing(file_id: str) -> NotFound:
    """The 404 of a file that does not exist (for its tenant)."""
    return NotFound(f"No such File object: {file_id}", param="file_id")


async def not_found(
    expiry: Expiry, kind: Literal["batch", "file"], tenant: str, record_id: str, file_id: str
) -> NotFound:
    """The 404 of a file not found: ``expired`` when the collector removed it (or its batch)."""
    return await expiry.gone_or(missing(file_id), kind, tenant, record_id, "file_id")


def file_object(stored: StoredFile) -> FileObject:
    """An upload as OpenAI's File object (``purpose=batch``)."""
    return FileObject(
        id=stored.id,
        bytes=stored.bytes,
        created_at=int(stored.created_at),
        filename=stored.filename,
        purpose="batch",
        expires_at=None if stored.expires_at is None else int(stored.expires_at),
    )


def result_object(result: results.ResultFile) -> FileObject:
    """A batch's output or error file as OpenAI's File object (``purpose=batch_output``)."""
    return FileObject(
        id=f"{OUTPUT_PREFIX if result.kind == 'output' else ERROR_PREFIX}{result.batch_id}",
        bytes=result.size,
        created_at=int(result.created_at),
        filename=f"{result.batch_id}_{result.kind}.jsonl",
        purpose="batch_output",
        expires_at=None if result.expires_at is None else int(result.expires_at),
    )
