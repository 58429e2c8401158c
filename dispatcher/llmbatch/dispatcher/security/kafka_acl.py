"""Kafka ACL bindings, one SASL user per role, each allowed only what that role's code does.

Every binding is an ALLOW on one literal resource (no wildcard, no prefix) named by
:class:`~llmbatch.settings.TopicSettings` or the dispatcher's consumer group:

- ``producer`` (the SDK :class:`llmbatch.producer.BatchClient`, ``llmbatch submit|cancel|watch``, the HTTP
API):
  Write + Describe on the requests topic (batch requests and cancels); Read + Describe on the results
  topic, which ``wait``/``watch`` follow without a consumer group. Nothing else: it cannot write results
  or dead letters, nor read requests.
- ``dispatcher``: Read + Describe on the requests topic and Read on its consumer group
  (``LLMBATCH_DISPATCHER__GROUP_ID``); Write + Describe on the results and dead-letter topics, Read on
  the results topic (the reconcile pass reads back the terminal events); DescribeConfigs on the three
  topics (:func:`llmbatch.adapters.topics.check_topic_sizes` at start). Its record readers, cancel read-ahead
  and
  reconcile pass read by position in no group, so they need no other group.
- ``operator`` (``llmbatch dlq``): Read + Describe on the dead-letter topic (read in no group) and
  Write + Describe on the requests topic (``dlq replay`` republishes there).

Deliberately absent:

- ``Create`` on the cluster or on the topics. :func:`llmbatch.adapters.topics.ensure_topics` (run by the
  dispatcher at start) creates nothing when the topics exist, and with Describe it sees them; the
  admin creates them once (``llmbatch dispatcher kafka-acl --apply`` does, with the admin's
  credentials). A dispatcher started before that retries and says which topic it may not create.
- ``IdempotentWrite`` on the cluster. The dispatcher's results producer is idempotent, but since
  KIP-679 (Kafka 3.0) a broker lets an idempotent producer start with Write on any topic; the SDK's
  producer is not idempotent by default.
- Transactional ids: nothing in llmbatch uses transactions (``read_committed`` reads need no grant).

Describe is implied by Read and Write in Kafka; it is listed anyway so each role's table reads
completely (``kafka-acls --list`` shows it the same way).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Literal, NamedTuple

from pydantic import BaseModel, ConfigDict

from llmbatch.settings import TopicSettings

Role = Literal["producer", "dispatcher", "operator"]
ROLES: tuple[Role, ...] = ("producer", "dispatcher", "operator")

ResourceType = Literal["TOPIC", "GROUP", "CLUSTER"]
Operation = Literal["READ", "WRITE", "CREATE", "DESCRIBE", "DESCRIBE_CONFIGS", "IDEMPOTENT_WRITE"]

# Kafka's wire codes (org.apache.kafka.common.resource.ResourceType, acl.AclOperation, ...)
RESOURCE_TYPE_CODES: dict[str, int] = {"TOPIC": 2, "GROUP": 3, "CLUSTER": 4}
OPERATION_CODES: dict[str, int] = {
    "READ": 3,
    "WRITE": 4,
    "CREATE": 5,
    "DESCRIBE": 8,
    "DESCRIBE_CONFIGS": 10,
    "IDEMPOTENT_WRITE": 12,
}
PATTERN_LITERAL = 3
PERMISSION_ALLOW = 3

# a SASL user name that is safe in a principal and in the test broker's SCRAM/JAAS files
_USER = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.@-]{0,127}")


class Grant(NamedTuple):
    """One operation a role needs on one resource, and the code that needs it."""

    resource_type: ResourceType
    resource_name: str
    operation: Operation
    why: str


class AclBinding(BaseModel):
    """One Kafka ACL binding: ``principal`` is allowed ``operation`` on a literal resource."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    role: Role
    principal: str
    resource_type: ResourceType
    resource_name: str
    pattern_type: Literal["LITERAL"] = "LITERAL"
    operation: Operation
    permission: Literal["ALLOW"] = "ALLOW"
    host: str = "*"
    why: str

    def key(self) -> tuple[str, str, str, str, str, str, str]:
        """What the broker stores (the role and the reason are ours)."""
        return (
            self.principal,
            self.resource_type,
            self.resource_name,
            self.pattern_type,
            self.operation,
            self.permission,
            self.host,
        )

    def describe(self) -> str:
        """``ALLOW WRITE on TOPIC name`` (one line, without the reason)."""
        return f"{self.permission} {self.operation} on {self.resource_type} {self.resource_name}"


def role_grants(topics: TopicSettings, group_id: str) -> dict[Role, list[Grant]]:
    """What each role needs, from the topic names and the dispatcher's consumer group. Pure.

    Raises :class:`ValueError` for a topic or group named ``*`` (a literal ``*`` is Kafka's wildcard)
    or empty."""
    for what, name in (
        ("requests topic", topics.requests),
        ("results topic", topics.results),
        ("dead-letter topic", topics.dead_letter),
        ("consumer group", group_id),
    ):
        if not name or name == "*":
            raise ValueError(f"the {what} is named {name!r}: a literal '*' is Kafka's wildcard, refused")
    req, res, dlt = topics.requests, topics.results, topics.dead_letter
    return {
        "producer": [
            Grant("TOPIC", req, "WRITE", "publish batch requests and cancels"),
            Grant("TOPIC", req, "DESCRIBE", "topic metadata before publishing"),
            Grant("TOPIC", res, "READ", "wait/watch follow the terminal events (no consumer group)"),
            Grant("TOPIC", res, "DESCRIBE", "partitions and offsets of the results topic"),
        ],
        "dispatcher": [
            Grant("TOPIC", req, "READ", "consume requests; read a request's body back by position"),
            Grant("TOPIC", req, "DESCRIBE", "metadata; ensure_topics sees the topic exists"),
            Grant("TOPIC", req, "DESCRIBE_CONFIGS", "check_topic_sizes at start"),
            Grant("GROUP", group_id, "READ", "join the consumer group and commit its offsets"),
            Grant("TOPIC", res, "WRITE", "publish terminal events (idempotent producer)"),
            Grant("TOPIC", res, "READ", "the reconcile pass reads terminal events back"),
            Grant("TOPIC", res, "DESCRIBE", "metadata; ensure_topics sees the topic exists"),
            Grant("TOPIC", res, "DESCRIBE_CONFIGS", "check_topic_sizes at start"),
            Grant("TOPIC", dlt, "WRITE", "publish dead letters"),
            Grant("TOPIC", dlt, "DESCRIBE", "metadata; ensure_topics sees the topic exists"),
            Grant("TOPIC", dlt, "DESCRIBE_CONFIGS", "check_topic_sizes at start"),
        ],
        "operator": [
            Grant("TOPIC", dlt, "READ", "dlq list/inspect/replay read the dead letters (no consumer group)"),
            Grant("TOPIC", dlt, "DESCRIBE", "partitions and offsets of the dead-letter topic"),
            Grant("TOPIC", req, "WRITE", "dlq replay republishes to the requests topic"),
            Grant("TOPIC", req, "DESCRIBE", "topic metadata before replaying"),
        ],
    }


def check_user(name: str) -> str:
    """``name`` if it can be a SASL user of a role, else :class:`ValueError` saying why."""
    if not _USER.fullmatch(name):
        raise ValueError(
            f"Kafka user name {name!r}: use letters, digits and _ . @ - (at most 128), "
            "starting with a letter or digit"
        )
    return name


def acl_bindings(
    topics: TopicSettings, group_id: str, users: Mapping[Role, Sequence[str]] | None = None
) -> list[AclBinding]:
    """The bindings of every role for its SASL user(s) (default: a user named like the role). Pure.

    Raises :class:`ValueError` for an unknown role, a role without users, or a bad user name."""
    names: dict[Role, Sequence[str]] = {r: [r] for r in ROLES}
    for role, given in (users or {}).items():
        if role not in names:
            raise ValueError(f"unknown Kafka role {role!r}: one of {', '.join(ROLES)}")
        if not given:
            raise ValueError(f"the {role} role has no user")
        names[role] = given
    grants = role_grants(topics, group_id)
    bindings: list[AclBinding] = []
    seen: set[tuple[str, ...]] = set()
    for role in ROLES:
        for user in names[role]:
            principal = f"User:{check_user(user)}"
            for grant in grants[role]:
                binding = AclBinding(
                    role=role,
                    principal=principal,
                    resource_type=grant.resource_type,
                    resource_name=grant.resource_name,
                    operation=grant.operation,
                    why=grant.why,
                )
                if binding.key() not in seen:  # one user in two roles gets each grant once
                    seen.add(binding.key())
                    bindings.append(binding)
    return bindings


def render(bindings: Sequence[AclBinding]) -> str:
    """The bindings per role and principal, one line each with the code that needs it."""
    lines: list[str] = []
    current: tuple[str, str] | None = None
    width = max((len(b.describe()) for b in bindings), default=0)
    for b in bindings:
        if (b.role, b.principal) != current:
            current = (b.role, b.principal)
            if lines:
                lines.append("")
            lines.append(f"{b.role} ({b.principal})")
        lines.append(f"  {b.describe():<{width}}  # {b.why}")
    return "\n".join(lines)
