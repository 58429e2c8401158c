"""Apply :mod:`llmbatch.dispatcher.security.kafka_acl`'s bindings to a broker, as an admin (a ``super.users``
principal).

aiokafka's admin client has no ACL methods; its protocol has the DescribeAcls/CreateAcls requests,
sent here through the admin client's own connection. Applying is idempotent: the principals' ACLs are
described first and only the missing bindings are created. ACLs of those principals that the plan does
not have are reported, never deleted (an operator may have granted them on purpose).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from llmbatch.dispatcher.errors import (
    DispatcherError,
    KafkaNotAuthorized,
    KafkaUnavailable,
    PermanentError,
    classify,
    classify_kafka_start,
)
from llmbatch.dispatcher.security.kafka_acl import (
    OPERATION_CODES,
    PATTERN_LITERAL,
    PERMISSION_ALLOW,
    RESOURCE_TYPE_CODES,
    AclBinding,
)
from llmbatch.settings import KafkaSettings

_ANY = 1  # the filters' "any" for resource type, pattern type, operation and permission
_CLUSTER_AUTHORIZATION_FAILED = 31
_SECURITY_DISABLED = 54

_NAMES = {
    "resource": {v: k for k, v in RESOURCE_TYPE_CODES.items()} | {5: "TRANSACTIONAL_ID", 7: "USER"},
    "operation": {v: k for k, v in OPERATION_CODES.items()}
    | {2: "ALL", 6: "DELETE", 7: "ALTER", 9: "CLUSTER_ACTION", 11: "ALTER_CONFIGS"},
    "pattern": {3: "LITERAL", 4: "PREFIXED"},
    "permission": {2: "DENY", 3: "ALLOW"},
}

Key = tuple[str, str, str, str, str, str, str]


class ApplyReport(BaseModel):
    """What :func:`apply_bindings` did: bindings created, already there, and other ACLs found."""

    created: list[AclBinding]
    present: list[AclBinding]
    other: list[str]
    """ACLs of the same principals that the plan does not have (``kafka-acls --list`` style), kept."""


async def apply_bindings(
    kafka: KafkaSettings, bindings: Sequence[AclBinding], *, timeout_s: float = 15.0
) -> ApplyReport:
    """Create the ``bindings`` the broker does not have yet, connecting with ``kafka``'s credentials.

    Raises:
        KafkaAuthenticationFailed: the broker refused the credentials.
        KafkaNotAuthorized: the user may not describe or create ACLs (not a super user).
        KafkaUnavailable: the broker did not answer within ``timeout_s``.
        PermanentError: the broker refused a binding, or runs no authorizer.
    """
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(**kafka.client_kwargs())
    try:
        try:
            await asyncio.wait_for(admin.start(), timeout_s)
        except Exception as exc:
            raise await classify_kafka_start(exc, kafka) from exc
        try:
            existing: set[Key] = set()
            for principal in sorted({b.principal for b in bindings}):
                existing |= await _describe(admin, principal, timeout_s)
            wanted = {b.key(): b for b in bindings}
            created = [b for k, b in wanted.items() if k not in existing]
            for binding in created:
                await _create(admin, binding, timeout_s)
        except DispatcherError:
            raise
        except Exception as exc:
            raise classify(exc, default=KafkaUnavailable) from exc
    finally:
        await admin.close()
    return ApplyReport(
        created=created,
        present=[b for k, b in wanted.items() if k in existing],
        other=[_show(k) for k in sorted(existing - wanted.keys())],
    )


async def _describe(admin: Any, principal: str, timeout_s: float) -> set[Key]:
    from aiokafka.protocol.admin import DescribeAclsRequest

    request = DescribeAclsRequest(_ANY, None, _ANY, principal, None, _ANY, _ANY)
    response = await asyncio.wait_for(admin._send_request(request), timeout_s)
    _check(response.error_code, response.error_message, f"describe the ACLs of {principal}")
    found: set[Key] = set()
    for resource_type, name, pattern, acls in response.resources:
        for acl_principal, host, operation, permission in acls:
            found.add(
                (
                    acl_principal,
                    _name("resource", resource_type),
                    name,
                    _name("pattern", pattern),
                    _name("operation", operation),
                    _name("permission", permission),
                    host,
                )
            )
    return found


async def _create(admin: Any, binding: AclBinding, timeout_s: float) -> None:
    from aiokafka.protocol.admin import CreateAclsRequest

    request = CreateAclsRequest(
        RESOURCE_TYPE_CODES[binding.resource_type],
        binding.resource_name,
        PATTERN_LITERAL,
        binding.principal,
        binding.host,
        OPERATION_CODES[binding.operation],
        PERMISSION_ALLOW,
    )
    response = await asyncio.wait_for(admin._send_request(request), timeout_s)
    for error_code, error_message in response.creation_responses:
        _check(error_code, error_message, f"create {binding.describe()} for {binding.principal}")


def _check(code: int, message: str | None, what: str) -> None:
    if code == 0:
        return
    if code == _CLUSTER_AUTHORIZATION_FAILED:
        raise KafkaNotAuthorized(
            f"Kafka does not allow this user to {what}: connect as a super user "
            "(the broker's super.users) with LLMBATCH_KAFKA__SASL_USERNAME/_PASSWORD"
        )
    if code == _SECURITY_DISABLED:
        raise PermanentError(f"cannot {what}: the broker runs no authorizer (authorizer.class.name)")
    raise PermanentError(f"cannot {what}: Kafka error {code} {message or ''}".strip())


def _name(kind: str, code: int) -> str:
    return _NAMES[kind].get(code, str(code))


def _show(key: Key) -> str:
    principal, resource_type, name, pattern, operation, permission, host = key
    return f"{principal} {permission} {operation} on {resource_type} {pattern}:{name} from host {host}"
