"""A batch request's fields, built and checked before anything is uploaded or published.

Pure (no I/O): each check turns the contract's errors into :class:`llmbatch.adapters.errors.InvalidInput`,
which names the field and the fix, so :class:`llmbatch.producer.client.BatchClient` fails before touching
Kafka or object storage.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import ValidationError

from llmbatch.adapters.errors import InvalidInput
from llmbatch.schemas import BatchRequest, InlineLimits, SchemaError, check_deadline, check_submittable

PLACEHOLDER_INPUT_URI = "s3://placeholder-bucket/x.jsonl"
"""Stands in for the input while the batch-level fields are checked alone (before any input is read)."""


@contextmanager
def invalid_input() -> Iterator[None]:
    """Translate the contract's errors raised inside into :class:`InvalidInput`: a pydantic
    ``ValidationError`` by its :class:`SchemaError` message, a :class:`SchemaError` with itself attached."""
    try:
        yield
    except ValidationError as exc:
        raise InvalidInput(str(SchemaError.from_validation_error(exc))) from None
    except SchemaError as exc:
        raise InvalidInput(str(exc), [exc]) from None


def check_fields(fields: dict[str, Any]) -> None:
    """Validate the batch-level fields alone (model, endpoint, metadata, priority, tenant, window,
    deadline), before any input is read."""
    with invalid_input():
        check_deadline(BatchRequest.model_validate({**fields, "input_uri": PLACEHOLDER_INPUT_URI}))


def build_request(fields: dict[str, Any]) -> BatchRequest:
    """The :class:`BatchRequest` of ``fields`` (with its ``requests`` or ``input_uri``)."""
    with invalid_input():
        return BatchRequest.model_validate(fields)


def check_request(request: BatchRequest, limits: InlineLimits) -> None:
    """Whether ``request`` may be published as it is: within ``limits``, deadline not passed."""
    with invalid_input():
        check_submittable(request, limits)


def fits_inline(request: BatchRequest, limits: InlineLimits) -> bool:
    """Whether ``request``'s inline lines are within ``limits`` (False: they go as a file instead).
    Any other contract error is raised as it is (a :class:`SchemaError`)."""
    try:
        check_submittable(request, limits, now=None)
    except SchemaError as exc:
        if exc.reason == "limit_exceeded":
            return False
        raise
    return True
