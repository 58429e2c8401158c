"""Dispatcher errors. Every error says whether retrying the same work can succeed (``retriable``).

Library exceptions (redis, aiokafka, Ray's HTTP client, minio) are translated at the boundary by
:func:`classify`, so the domain code only ever sees :class:`DispatcherError` subclasses.
"""

from __future__ import annotations

import asyncio
import errno
from typing import TYPE_CHECKING

from llmbatch.schemas.errors import LLMBatchError

if TYPE_CHECKING:
    from llmbatch.settings import KafkaSettings


class DispatcherError(LLMBatchError):
    """Base class. ``retriable`` tells the caller whether the same call may succeed later."""

    retriable: bool = False
    code: str = "internal_error"


class TransientError(DispatcherError):
    """A dependency is unavailable or slow; the same operation should be retried with backoff."""

    retriable = True
    code = "unavailable"


class StateStoreUnavailable(TransientError):
    code = "redis_unavailable"


class KafkaUnavailable(TransientError):
    code = "kafka_unavailable"


class RayUnavailable(TransientError):
    code = "ray_unavailable"


class StorageUnavailable(TransientError):
    code = "storage_unavailable"


class PermanentError(DispatcherError):
    """Retrying the same operation cannot succeed."""

    retriable = False


class RecordTooLarge(PermanentError):
    """The broker (or the producer, before sending) refused a record over the topic's
    ``max.message.bytes``; the same record never fits, a smaller one may."""

    code = "record_too_large"


class RequestUnavailable(PermanentError):
    """A batch's request body is not in Redis and the requests topic no longer has it."""

    code = "request_gone"


class ConflictError(PermanentError):
    """A compare-and-set lost: the batch moved on (its version or state differs)."""

    code = "conflict"


class Misconfiguration(PermanentError):
    """A dependency refuses this service for how it is set up (credentials, ACLs, memory): never a
    record's fault. Retrying does not help until an operator fixes it, so intake pauses on it (it
    neither dead-letters nor answers the record) and says why (readiness, a metric, one log line)."""


class KafkaNotAuthorized(Misconfiguration):
    """The broker's ACLs refuse this user the operation (a topic, the consumer group, the cluster):
    retrying cannot help until an admin grants it (``llmbatch dispatcher kafka-acl``)."""

    code = "kafka_not_authorized"


class KafkaAuthenticationFailed(Misconfiguration):
    """The broker refused the SASL credentials (LLMBATCH_KAFKA__SASL_USERNAME / _PASSWORD)."""

    code = "kafka_authentication_failed"


class RedisNotPermitted(Misconfiguration):
    """Redis' ACL refuses this user the command or key (``NOPERM``): ``llmbatch dispatcher redis-acl``."""

    code = "redis_not_permitted"


class RedisOutOfMemory(Misconfiguration):
    """Redis is at ``maxmemory`` and refuses writes (``OOM``): raise it, or free memory."""

    code = "redis_out_of_memory"


class RedisAuthenticationFailed(Misconfiguration):
    """Redis refused the credentials (LLMBATCH_REDIS__PASSWORD / the URL's user)."""

    code = "redis_authentication_failed"


class DeadLetterRefused(Misconfiguration):
    """The dead-letter topic refused a record's dead letter for good (even its reduced form): with
    nowhere to put the record, intake pauses on it rather than move past it without a trace."""

    code = "dead_letter_refused"


MISCONFIGURATION_CODES = (
    "kafka_not_authorized",
    "kafka_authentication_failed",
    "redis_not_permitted",
    "redis_out_of_memory",
    "redis_authentication_failed",
    "dead_letter_refused",
)
"""The causes intake pauses on (the label values of ``llmbatch_dispatcher_intake_paused``)."""


class InvalidSettings(PermanentError):
    """The settings cannot run a dispatcher (e.g. no model configured); the message says the fix."""

    code = "invalid_settings"


class JobRejected(PermanentError):
    """Ray refused the job submission for a reason that will not change (bad runtime_env, ...)."""

    code = "job_rejected"


class ManifestInvalid(DispatcherError):
    """A finished job left no readable manifest; the job attempt is retried."""

    retriable = True
    code = "manifest_invalid"


_NOT_AUTHORIZED = {
    "TopicAuthorizationFailedError",
    "GroupAuthorizationFailedError",
    "ClusterAuthorizationFailedError",
    "TransactionalIdAuthorizationFailed",
}

_TRANSIENT_ERRNOS = {
    errno.ECONNREFUSED,
    errno.ECONNRESET,
    errno.ETIMEDOUT,
    errno.EPIPE,
    errno.EHOSTUNREACH,
    errno.ENETUNREACH,
    errno.ECONNABORTED,
}


def classify(exc: BaseException, *, default: type[DispatcherError] = TransientError) -> DispatcherError:
    """Translate a library exception into a :class:`DispatcherError` (already-translated: as is).

    ``default`` is the transient class to use for connection-type failures of the calling boundary
    (e.g. :class:`StateStoreUnavailable` around Redis calls).
    """
    if isinstance(exc, DispatcherError):
        return exc
    message = f"{type(exc).__name__}: {exc}"[:500]
    try:
        import redis.exceptions as rexc

        if isinstance(exc, rexc.NoPermissionError):
            return RedisNotPermitted(f"Redis refused it ({message}): the user lacks an ACL rule")
        if isinstance(exc, rexc.OutOfMemoryError):
            return RedisOutOfMemory(f"Redis is out of memory ({message}): raise maxmemory or free memory")
        if isinstance(exc, rexc.AuthenticationError):
            return RedisAuthenticationFailed(f"Redis refused the credentials ({message})")
        if isinstance(
            exc,
            rexc.ConnectionError
            | rexc.TimeoutError
            | rexc.BusyLoadingError
            | rexc.TryAgainError
            | rexc.ClusterDownError,
        ):
            return StateStoreUnavailable(message)
        if isinstance(exc, rexc.ResponseError):
            text = str(exc)
            if text.startswith(("LOADING", "BUSY", "MASTERDOWN", "READONLY", "TRYAGAIN", "CLUSTERDOWN")):
                return StateStoreUnavailable(message)
            return PermanentError(message)
    except ImportError:  # pragma: no cover - redis is a dependency
        pass
    try:
        from aiokafka.errors import KafkaError

        if isinstance(exc, KafkaError):
            if type(exc).__name__ in {"MessageSizeTooLargeError", "RecordTooLargeError"}:
                return RecordTooLarge(message)
            if type(exc).__name__ in _NOT_AUTHORIZED:
                return KafkaNotAuthorized(
                    f"Kafka refused it ({message}): the user lacks an ACL; "
                    "`llmbatch dispatcher kafka-acl` lists each role's"
                )
            if type(exc).__name__ in {"SaslAuthenticationFailed", "AuthenticationFailedError"}:
                return KafkaAuthenticationFailed(message)
            if getattr(exc, "retriable", False) or type(exc).__name__ in {
                "KafkaConnectionError",
                "KafkaTimeoutError",
                "RequestTimedOutError",
                "NodeNotReadyError",
                "NotLeaderForPartitionError",
                "LeaderNotAvailableError",
                "NotEnoughReplicasError",
                "CoordinatorNotAvailableError",
                "NotCoordinatorError",
                "UnknownTopicOrPartitionError",
            }:
                return KafkaUnavailable(message)
            return PermanentError(message)
    except ImportError:  # pragma: no cover
        pass
    if isinstance(exc, asyncio.TimeoutError | TimeoutError | ConnectionError):
        return default(message)
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return default(message)
    name = type(exc).__name__
    module = type(exc).__module__ or ""
    if module.startswith(("requests", "urllib3", "aiohttp")) and (
        "Connection" in name
        or "Timeout" in name
        or "Protocol" in name
        or "Chunked" in name
        or name == "MaxRetryError"  # urllib3 gave up retrying (refused connections, repeated 5xx)
    ):
        return default(message)
    return PermanentError(message)


async def classify_kafka_start(exc: BaseException, kafka: KafkaSettings) -> DispatcherError:
    """:func:`classify` for a Kafka client that failed to start. aiokafka reports a refused SASL
    login as "Unable to bootstrap" (an outage, retried for ever); a direct login says whether the
    credentials were refused, which is :class:`KafkaAuthenticationFailed` (not retriable)."""
    error = classify(exc, default=KafkaUnavailable)
    if error.retriable and kafka.security_protocol.startswith("SASL"):
        from llmbatch.adapters.kafka import authentication_failure

        why = await authentication_failure(kafka)
        if why is not None:
            return KafkaAuthenticationFailed(why)
    return error
