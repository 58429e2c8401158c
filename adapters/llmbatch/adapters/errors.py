"""Errors of the producer SDK: one hierarchy rooted at :class:`ProducerError`.

``retriable`` tells a caller whether trying the same call again later may succeed (broker or
storage unreachable, timeouts) or not (invalid input). Contract violations found while building a
request surface as :class:`InvalidInput`, which wraps the :class:`llmbatch.schemas.errors.SchemaError`\\ s.
"""

from __future__ import annotations

from collections.abc import Sequence

from llmbatch.schemas.errors import LLMBatchError, SchemaError


class ProducerError(LLMBatchError):
    """Base of every error the SDK raises on purpose."""

    retriable: bool = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidInput(ProducerError):
    """The batch or one of its lines violates the contract; nothing was uploaded or published."""

    def __init__(self, message: str, errors: Sequence[SchemaError] = (), *, invalid_count: int | None = None):
        super().__init__(message)
        self.errors = list(errors)
        self.invalid_count = len(self.errors) if invalid_count is None else invalid_count


class InputFileError(ProducerError):
    """The local input file cannot be read (missing, a directory, no permission)."""


class BrokerUnavailable(ProducerError):
    """Kafka could not be reached or did not acknowledge in time."""

    retriable = True


class PublishFailed(ProducerError):
    """Kafka rejected the record (e.g. too large, not authorised)."""


class NotAuthorized(PublishFailed):
    """The broker's ACLs refuse this user the topic (e.g. writing the results topic): retrying cannot
    help until an admin grants it."""


class AuthenticationFailed(ProducerError):
    """The broker refused the SASL credentials (LLMBATCH_KAFKA__SASL_USERNAME / _PASSWORD)."""


class TopicMissing(ProducerError):
    """A topic the call needs does not exist (run ``ensure_topics`` or ask an operator)."""

    retriable = True


class StorageError(ProducerError):
    """Object storage failed (unreachable, denied, missing bucket)."""

    def __init__(self, message: str, *, retriable: bool = True) -> None:
        super().__init__(message)
        self.retriable = retriable


class ResultsNotFound(ProducerError):
    """A batch has no results (yet): its manifest is not in the results bucket."""

    retriable = True


class WaitTimeout(ProducerError):
    """No terminal event arrived within the timeout; the batch may still be running."""

    retriable = True
