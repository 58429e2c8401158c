"""Redis ACL users, one per component, each allowed only what that component does.

- ``dispatcher``: every key under its prefix, every command but the dangerous ones (it reads
  ``CONFIG GET appendfsync`` to warn about a lossy Redis), and one Pub/Sub channel, the one that wakes
  the replicas' trackers (``<p>:tracker:wake``).
- ``job`` (Ray jobs and the batch runner): only the progress hashes (``<p>:progress:*``) and only the
  commands :mod:`llmbatch.ray_job.job.progress` runs (its script ``write_progress.lua`` and ``HMGET``), plus
  ``GETDEL``
  and nothing else on the S3 sessions (``<p>:s3session:*``, a Redis 7 selector), which a driver takes
  once by a name it alone is given, and the batch runner's runs (``<p>:runner:*``: ``GET``, ``MGET``,
  ``SET``, ``DEL``; :mod:`llmbatch.ray_job.batch_runner.run_store`). A job (user prompts, a model's code)
  cannot read or write any batch's state, and cannot list the sessions.
- ``operator`` (``llmbatch jobs`` / ``dlq``): reads every key of the layout but the S3 sessions (a job's
  keys are no operator's business: :data:`OPERATOR_READS`), writes only the replay ledger
  (``<p>:dlq:replayed:*`` and its by-time index ``<p>:dlq:replayed-at:*``) and the tenants' webhook
  endpoints (``<p>:webhook:endpoints:*``, which the HTTP API manages).

Passwords are given as SHA-256 hashes (``#<hex>``), so the ACL file holds no password. Key patterns
come from :class:`llmbatch.dispatcher.domain.keys.Keys`, the one place key names are made.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from typing import Literal

from llmbatch.dispatcher.domain.keys import Keys
from llmbatch.ray_job.storage import job_keys

Role = Literal["dispatcher", "job", "operator"]
ROLES: tuple[Role, ...] = ("dispatcher", "job", "operator")

# what a redis-py client sends on connect (HELLO/AUTH, SELECT for db > 0, PING; its CLIENT SETINFO is
# left out: Redis 7.0 does not know it, and redis-py ignores a refusal)
_CONNECTION = "+hello +auth +ping +select +client|setname +readonly"


def _glob(text: str) -> str:
    """``text`` as a literal in a Redis glob pattern."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)


OPERATOR_READS = (
    "batch:*",
    "state:*",
    "ready",
    "delayed",
    "deadlines",
    "unpublished",
    "progress:*",
    "jobs:delete",
    "event:*",
    "lease:*",
    "tenant:*",
    "tenants",
    "dlq:replayed:*",
    "dlq:replayed-at:*",
    "webhook:*",
    "usage:*",
    "quota:*",
    "retention:*",
    "stored:*",
)
"""What the operator reads, after ``<p>:``: every key :class:`llmbatch.dispatcher.domain.keys.Keys` makes but
the S3
sessions (a unit test holds the two together)."""


def acl_rules(keys: Keys) -> dict[Role, str]:
    """The ACL rules (without user name and password) of each role for ``keys``' prefix."""
    p = _glob(keys.prefix)
    return {
        "dispatcher": (
            f"resetkeys ~{p}:* resetchannels &{_glob(keys.tracker_wake)} -@all +@all -@dangerous "
            f"+config|get +info {_CONNECTION}"
        ),
        "job": (
            f"resetkeys ~{p}:progress:* resetchannels -@all "
            f"+evalsha +eval +script|load +hmget +hget +hexists +hset +expire {_CONNECTION} "
            f"(~{_glob(keys.s3_session_prefix)}* +getdel) "
            f"(~{_glob(job_keys.runner_prefix(keys.prefix))}* +get +mget +set +del)"
        ),
        "operator": (
            "resetkeys "
            + " ".join(f"%R~{p}:{pattern}" for pattern in OPERATOR_READS)
            + f" ~{p}:dlq:replayed:* ~{p}:dlq:replayed-at:* ~{p}:webhook:endpoints:*"
            + " resetchannels -@all +@read +@hash +zadd +zrem"
            + f" +expire +multi +exec +@connection -@dangerous {_CONNECTION}"
        ),
    }


def acl_lines(keys: Keys, passwords: Mapping[Role, str]) -> list[str]:
    """ACL file lines (``user <role> on #<sha256> <rules>``) for the roles in ``passwords``.

    Raises :class:`ValueError` for an unknown role or an empty password."""
    rules = acl_rules(keys)
    lines = []
    for role, password in passwords.items():
        if role not in rules:
            raise ValueError(f"unknown Redis role {role!r}: one of {', '.join(ROLES)}")
        if not password:
            raise ValueError(f"the {role} user's password is empty")
        digest = hashlib.sha256(password.encode()).hexdigest()
        lines.append(f"user {role} reset on #{digest} {rules[role]}")
    return lines
