"""OpenAI's objects as the API returns them: File, Batch (with its counts, usage and errors), list
pages, and the bodies the API accepts.

Field names, types and literals follow OpenAI's API reference (and the ``openai`` SDK's models, which
the tests validate every response with). Timestamps are Unix seconds.
"""

from __future__ import annotations

from typing import Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from llmbatch.schemas.common import Endpoint, ExpiresAfter, Metadata

BatchStatusName = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
"""OpenAI's batch statuses (see :mod:`llmbatch.api.batches.status` for how llmbatch's states map onto
them)."""
TERMINAL_STATUSES: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})
FilePurpose = Literal["batch", "batch_output"]
"""Purposes this API serves: uploads are ``batch``; a batch's result files are ``batch_output``."""

T = TypeVar("T", bound=BaseModel)


class FileObject(BaseModel):
    """OpenAI's File object."""

    id: str
    object: Literal["file"] = "file"
    bytes: int = Field(ge=0)
    created_at: int
    filename: str
    purpose: FilePurpose
    status: Literal["uploaded", "processed", "error"] = "processed"
    expires_at: int | None = None
    status_details: str | None = None


class FileDeleted(BaseModel):
    """Answer of ``DELETE /v1/files/{file_id}``."""

    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchRequestCounts(BaseModel):
    """Requests of a batch: all of them, those that succeeded, those that failed."""

    total: int = Field(default=0, ge=0)
    completed: int = Field(default=0, ge=0)
    failed: int = Field(default=0, ge=0)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class BatchUsage(BaseModel):
    """Tokens the batch used so far (llmbatch counts prompt and completion tokens only)."""

    input_tokens: int = Field(default=0, ge=0)
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = Field(default=0, ge=0)
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = Field(default=0, ge=0)


class BatchError(BaseModel):
    """One entry of ``Batch.errors.data``."""

    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError] = Field(default_factory=list)


class Batch(BaseModel):
    """OpenAI's Batch object."""

    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    model: str | None = None
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatusName
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    usage: BatchUsage | None = None
    metadata: dict[str, str] | None = None
    priority: int | None = Field(default=None, description="llmbatch's extension: the batch's priority, 0-9.")


class ListPage(BaseModel, Generic[T]):
    """OpenAI's cursor page: ``after=<last_id>`` fetches the next one while ``has_more``."""

    object: Literal["list"] = "list"
    data: list[T]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False

    @classmethod
    def of(cls, items: list[T], *, has_more: bool, ids: list[str]) -> ListPage[T]:
        """A page of ``items`` whose ids are ``ids`` (same order)."""
        return cls(
            data=items, first_id=ids[0] if ids else None, last_id=ids[-1] if ids else None, has_more=has_more
        )


class BatchCreate(BaseModel):
    """Body of ``POST /v1/batches``."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str = Field(min_length=1, max_length=128, description="An uploaded file (purpose batch).")
    endpoint: Endpoint = Field(description="/v1/chat/completions or /v1/completions: the url of every line.")
    completion_window: str | None = Field(
        default=None,
        max_length=16,
        description="'24h' as OpenAI; llmbatch also takes e.g. '90m', '2d' (up to 7d).",
    )
    metadata: Metadata | None = None
    priority: int | None = Field(
        default=None,
        ge=0,
        le=9,
        description="llmbatch's extension: the batch's priority, 0 (lowest) to 9 (the API's "
        "LLMBATCH_API__PRIORITY when left out). With the openai SDK: extra_body={'priority': 9}.",
    )
    output_expires_after: ExpiresAfter | None = Field(
        default=None,
        description="How long the batch's result files are kept after it ends ({'anchor': 'created_at', "
        "'seconds': 3600-2592000}); left out: the tenant's retention (LLMBATCH_RETENTION__*).",
    )
