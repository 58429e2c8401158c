"""llmbatch producer: the client SDK and CLI for upstream services.

- :class:`~llmbatch.producer.client.BatchClient` (async) and :class:`~llmbatch.producer.sync.SyncBatchClient`:
  submit (inline requests or a local JSONL file), cancel, follow events, wait, read results.
- :func:`~llmbatch.adapters.topics.ensure_topics`: create the llmbatch topics when missing.
- :mod:`llmbatch.producer.cli`: ``submit``, ``cancel``, ``watch``, ``results`` (``register(app)``).
- :mod:`llmbatch.adapters.errors`: :class:`ProducerError` and subclasses, each with ``retriable``.

Importing this package does not import aiokafka or minio; they load on first use.
"""

from llmbatch.adapters.errors import (
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
from llmbatch.adapters.kafka import Published
from llmbatch.adapters.topics import ensure_topics
from llmbatch.producer.client import BatchClient, BatchHandle, ClientOptions, new_batch_id
from llmbatch.producer.sync import SyncBatchClient

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
