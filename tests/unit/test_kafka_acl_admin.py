"""Applying the ACL plan as the broker's admin (dispatcher.kafka_acl_admin) against an in-memory broker
that answers aiokafka's DescribeAcls/CreateAcls requests with aiokafka's own response structs (through
their wire encoding): only the missing bindings are created, the present ones and the principals' other
ACLs are reported, the broker's refusals and outages become the dispatcher's errors, and the admin
client is always closed. On a real broker: tests/integration/test_kafka_acl.py."""

from __future__ import annotations

import asyncio
import inspect
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient as REAL_ADMIN
from aiokafka.errors import KafkaConnectionError, NodeNotReadyError, UnknownError
from aiokafka.protocol.admin import (
    CreateAclsRequest,
    CreateAclsRequest_v1,
    CreateAclsResponse_v1,
    DescribeAclsRequest,
    DescribeAclsRequest_v1,
    DescribeAclsResponse_v1,
)

from llmbatch.dispatcher.errors import (
    KafkaAuthenticationFailed,
    KafkaNotAuthorized,
    KafkaUnavailable,
    PermanentError,
)
from llmbatch.dispatcher.security import kafka_acl_admin
from llmbatch.dispatcher.security.kafka_acl import AclBinding, acl_bindings
from llmbatch.dispatcher.security.kafka_acl_admin import apply_bindings
from llmbatch.settings import KafkaSettings, TopicSettings

pytestmark = pytest.mark.unit

TOPICS = TopicSettings(requests="t.req", results="t.res", dead_letter="t.dlt")
PLAN = acl_bindings(TOPICS, "g1")
KAFKA = KafkaSettings(bootstrap_servers="kafka.test:9092")
SASL = KafkaSettings(
    bootstrap_servers="kafka.test:9092",
    security_protocol="SASL_PLAINTEXT",
    sasl_mechanism="SCRAM-SHA-512",
    sasl_username="admin",
    sasl_password="admin-pw",
)

# (resource type, name, pattern type, principal, host, operation, permission) in Kafka's wire codes
Acl = tuple[int, str, int, str, str, int, int]
TOPIC, GROUP, LITERAL, PREFIXED, ALLOW, DENY = 2, 3, 3, 4, 3, 2
READ, WRITE, DESCRIBE, ALL = 3, 4, 8, 2


@dataclass
class Broker:
    """A broker's ACLs, and what an admin client on it was asked."""

    acls: set[Acl] = field(default_factory=set)
    describe_error: tuple[int, str | None] = (0, None)
    create_error: tuple[int, str | None] = (0, None)
    fail_start: BaseException | None = None
    hang_start: bool = False
    fail_send: BaseException | None = None
    described: list[str] = field(default_factory=list)
    created: list[Acl] = field(default_factory=list)
    clients: list[FakeAdmin] = field(default_factory=list)

    def acl(self, binding: AclBinding) -> Acl:
        codes = {
            "TOPIC": TOPIC,
            "GROUP": GROUP,
            "READ": READ,
            "WRITE": WRITE,
            "DESCRIBE": DESCRIBE,
            "DESCRIBE_CONFIGS": 10,
        }
        return (
            codes[binding.resource_type],
            binding.resource_name,
            LITERAL,
            binding.principal,
            binding.host,
            codes[binding.operation],
            ALLOW,
        )


class FakeAdmin:
    """aiokafka's ``AIOKafkaAdminClient`` as apply_bindings uses it, answering from a :class:`Broker`."""

    broker: Broker

    def __init__(self, **kwargs: Any) -> None:
        inspect.signature(REAL_ADMIN).bind(**kwargs)  # the real client takes every keyword given
        self.kwargs = kwargs
        self.started = self.closed = False
        self.broker.clients.append(self)

    async def start(self) -> None:
        if self.broker.hang_start:
            await asyncio.Event().wait()
        if self.broker.fail_start is not None:
            raise self.broker.fail_start
        self.started = True

    async def close(self) -> None:
        self.closed = True

    async def _send_request(self, request: Any, node_id: int | None = None) -> Any:
        assert self.started and not self.closed
        if self.broker.fail_send is not None:
            raise self.broker.fail_send
        if isinstance(request, DescribeAclsRequest):
            return self._describe(request.build(DescribeAclsRequest_v1))
        assert isinstance(request, CreateAclsRequest)
        return self._create(request.build(CreateAclsRequest_v1))

    def _describe(self, query: Any) -> Any:
        # the filter apply_bindings sends: any resource, pattern, operation, permission of one principal
        assert (query.resource_type, query.resource_name, query.resource_pattern_type_filter) == (1, None, 1)
        assert (query.host, query.operation, query.permission_type) == (None, 1, 1)
        self.broker.described.append(query.principal)
        code, message = self.broker.describe_error
        resources: dict[tuple[int, str, int], list[tuple[str, str, int, int]]] = {}
        for rtype, name, pattern, principal, host, operation, permission in sorted(self.broker.acls):
            if principal == query.principal and code == 0:
                acl = (principal, host, operation, permission)
                resources.setdefault((rtype, name, pattern), []).append(acl)
        response = DescribeAclsResponse_v1(0, code, message, [(*k, v) for k, v in resources.items()])
        return DescribeAclsResponse_v1.decode(response.encode())

    def _create(self, request: Any) -> Any:
        [creation] = request.creations
        code, message = self.broker.create_error
        if code == 0:
            self.broker.acls.add(creation)
            self.broker.created.append(creation)
        response = CreateAclsResponse_v1(0, [(code, message)])
        return CreateAclsResponse_v1.decode(response.encode())


@pytest.fixture
def broker(monkeypatch: pytest.MonkeyPatch) -> Broker:
    import aiokafka.admin

    made = Broker()
    admin = type("BoundFakeAdmin", (FakeAdmin,), {"broker": made})
    monkeypatch.setattr(aiokafka.admin, "AIOKafkaAdminClient", admin)
    return made


def keys(bindings: list[AclBinding]) -> set[tuple[str, ...]]:
    return {b.key() for b in bindings}


# --- what gets created -------------------------------------------------------------------------------------


async def test_only_the_missing_bindings_are_created_and_a_second_run_creates_none(broker: Broker) -> None:
    producer = [b for b in PLAN if b.role == "producer"]
    broker.acls = {broker.acl(b) for b in producer}
    report = await apply_bindings(KAFKA, PLAN)
    assert keys(report.present) == keys(producer)
    assert keys(report.created) == keys(PLAN) - keys(producer)
    assert report.other == []
    # what was sent: one literal ALLOW per missing binding, exactly the plan's
    assert sorted(broker.created) == sorted({broker.acl(b) for b in report.created})
    assert broker.acls == {broker.acl(b) for b in PLAN}
    # each principal described once, the plan's only
    assert broker.described == sorted({b.principal for b in PLAN})
    [client] = broker.clients
    assert client.closed and client.kwargs["bootstrap_servers"] == "kafka.test:9092"

    again = await apply_bindings(KAFKA, PLAN)
    assert again.created == [] and keys(again.present) == keys(PLAN)
    assert len(broker.created) == len(report.created)


async def test_other_acls_of_the_principals_are_reported_in_kafka_acls_style_and_kept(broker: Broker) -> None:
    ops = [b for b in PLAN if b.role == "operator"]
    unplanned: set[Acl] = {
        (GROUP, "g", PREFIXED, "User:operator", "10.0.0.1", ALL, DENY),
        (TOPIC, "t.req", LITERAL, "User:operator", "*", READ, ALLOW),
        (9, "x", 7, "User:operator", "*", 99, 5),  # codes the module has no names for
        (TOPIC, "t.req", LITERAL, "User:intruder", "*", WRITE, ALLOW),  # not a principal of the plan
    }
    broker.acls = set(unplanned)
    report = await apply_bindings(KAFKA, ops)
    assert keys(report.created) == keys(ops) and report.present == []
    assert report.other == [
        "User:operator 5 99 on 9 7:x from host *",
        "User:operator DENY ALL on GROUP PREFIXED:g from host 10.0.0.1",
        "User:operator ALLOW READ on TOPIC LITERAL:t.req from host *",
    ]
    assert unplanned <= broker.acls  # nothing deleted
    assert broker.described == ["User:operator"]


# --- refusals and outages ----------------------------------------------------------------------------------


@pytest.mark.parametrize("step", ["describe", "create"])
async def test_a_user_who_is_no_super_user_is_not_authorized_naming_super_users(
    broker: Broker, step: str
) -> None:
    setattr(broker, f"{step}_error", (31, "Cluster authorization failed."))
    with pytest.raises(KafkaNotAuthorized) as caught:
        await apply_bindings(KAFKA, PLAN[:1])
    message = str(caught.value)
    assert "super.users" in message and "LLMBATCH_KAFKA__SASL_USERNAME" in message
    what = (
        "describe the ACLs of User:producer"
        if step == "describe"
        else (f"create {PLAN[0].describe()} for User:producer")
    )
    assert what in message
    assert not caught.value.retriable
    assert broker.clients[0].closed


async def test_a_broker_without_an_authorizer_is_a_permanent_error_naming_the_setting(broker: Broker) -> None:
    broker.describe_error = (54, "Security features are disabled.")
    with pytest.raises(PermanentError, match=r"runs no authorizer \(authorizer\.class\.name\)") as caught:
        await apply_bindings(KAFKA, PLAN)
    assert not isinstance(caught.value, KafkaNotAuthorized)
    assert broker.created == [] and broker.clients[0].closed


async def test_another_refused_binding_names_it_and_the_brokers_code(broker: Broker) -> None:
    broker.create_error = (42, "Invalid request")
    with pytest.raises(PermanentError) as caught:
        await apply_bindings(KAFKA, PLAN[:1])
    assert str(caught.value) == (
        f"cannot create {PLAN[0].describe()} for User:producer: Kafka error 42 Invalid request"
    )
    assert type(caught.value) is PermanentError and broker.clients[0].closed


@pytest.mark.parametrize("error", [KafkaConnectionError("gone"), NodeNotReadyError()], ids=["conn", "node"])
async def test_an_outage_after_the_start_is_a_retriable_broker_outage(
    broker: Broker, error: Exception
) -> None:
    broker.fail_send = error
    with pytest.raises(KafkaUnavailable) as caught:
        await apply_bindings(KAFKA, PLAN)
    assert caught.value.retriable and caught.value.__cause__ is error
    assert broker.clients[0].closed


async def test_an_unknown_library_error_is_permanent(broker: Broker) -> None:
    broker.fail_send = UnknownError()
    with pytest.raises(PermanentError):
        await apply_bindings(KAFKA, PLAN)
    assert broker.clients[0].closed


async def test_a_refused_login_at_start_says_so_instead_of_an_outage(
    broker: Broker, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llmbatch.adapters.kafka as kafka_adapter

    asked: list[KafkaSettings] = []

    async def refused(kafka: KafkaSettings, timeout_s: float = 10.0) -> str:
        asked.append(kafka)
        return "Kafka at kafka.test:9092 refused the SCRAM-SHA-512 login of user 'admin'"

    monkeypatch.setattr(kafka_adapter, "authentication_failure", refused)
    broker.fail_start = KafkaConnectionError("Unable to bootstrap from [('kafka.test', 9092)]")
    with pytest.raises(KafkaAuthenticationFailed, match="refused the SCRAM-SHA-512 login"):
        await apply_bindings(SASL, PLAN)
    assert asked == [SASL] and broker.described == [] and broker.clients[0].closed
    # without SASL the same failure is an outage, retried
    with pytest.raises(KafkaUnavailable):
        await apply_bindings(KAFKA, PLAN)
    assert asked == [SASL] and broker.clients[1].closed


async def test_a_start_that_does_not_answer_times_out_as_an_outage(broker: Broker) -> None:
    broker.hang_start = True
    with pytest.raises(KafkaUnavailable):
        await asyncio.wait_for(apply_bindings(KAFKA, PLAN, timeout_s=0.05), 5)  # not: hangs for ever
    assert broker.clients[0].closed


# --- the names of the codes --------------------------------------------------------------------------------


def test_codes_are_named_as_kafka_acls_names_them_and_unknown_ones_kept_as_numbers() -> None:
    name = kafka_acl_admin._name
    assert [name("resource", c) for c in (2, 3, 4, 5, 7, 0)] == [
        "TOPIC",
        "GROUP",
        "CLUSTER",
        "TRANSACTIONAL_ID",
        "USER",
        "0",
    ]
    assert [name("operation", c) for c in (2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13)] == [
        "ALL",
        "READ",
        "WRITE",
        "CREATE",
        "DELETE",
        "ALTER",
        "DESCRIBE",
        "CLUSTER_ACTION",
        "DESCRIBE_CONFIGS",
        "ALTER_CONFIGS",
        "IDEMPOTENT_WRITE",
        "13",
    ]
    assert [name("pattern", c) for c in (3, 4, 5)] == ["LITERAL", "PREFIXED", "5"]
    assert [name("permission", c) for c in (2, 3, 1)] == ["DENY", "ALLOW", "1"]


def test_a_success_code_passes_and_a_code_without_a_message_reads_cleanly() -> None:
    kafka_acl_admin._check(0, "ignored", "do it")
    with pytest.raises(PermanentError) as caught:
        kafka_acl_admin._check(87, None, "do it")
    assert str(caught.value) == "cannot do it: Kafka error 87"
