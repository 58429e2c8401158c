"""llmbatch producer: the client SDK and CLI for upstream services.

- :class:`~producer.client.BatchClient` (async) and :class:`~producer.sync.SyncBatchClient`:
  submit (inline requests or a local JSONL file), cancel, follow events, wait, read results.
- :func:`~producer.topics.ensure_topics`: create the llmbatch topics when missing.
- :mod:`producer.cli`: ``submit``, ``cancel``, ``watch``, ``results`` (``register(app)``).
- :mod:`producer.errors`: :class:`ProducerError` and subclasses, each with ``retriable``.

Importing this package does not import aiokafka or minio; they load on first use.
"""

from producer.client import BatchClient, BatchHandle, ClientOptions, new_batch_id
from producer.errors import (
    AuthenticationFailed,
    BrokerUnavailable,
    InputFileError,
    InvalidInput,
    NotAuthorized,
    ProducerError,
    PublishFailed,
    ResultsNotFound,
    StorageError,
    TopicMissing,
    WaitTimeout,
)
from producer.kafka import Published
from producer.sync import SyncBatchClient
from producer.topics import ensure_topics

__all__ = [
    "AuthenticationFailed",
    "BatchClient",
    "BatchHandle",
    "BrokerUnavailable",
    "ClientOptions",
    "InputFileError",
    "InvalidInput",
    "NotAuthorized",
    "ProducerError",
    "PublishFailed",
    "Published",
    "ResultsNotFound",
    "StorageError",
    "SyncBatchClient",
    "TopicMissing",
    "WaitTimeout",
    "ensure_topics",
    "new_batch_id",
]
