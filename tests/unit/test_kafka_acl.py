"""Kafka least privilege without a broker: each role's ACL bindings (dispatcher.kafka_acl), the
``llmbatch dispatcher kafka-acl`` command, the test broker's SASL settings, and how refusals are
reported. The bindings are exercised on a real broker in tests/integration/test_kafka_acl.py."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiokafka.errors import (
    GroupAuthorizationFailedError,
    KafkaConnectionError,
    SaslAuthenticationFailed,
    TopicAuthorizationFailedError,
)
from typer.testing import CliRunner

from llmbatch.adapters.errors import NotAuthorized
from llmbatch.adapters.kafka import Publisher
from llmbatch.dispatcher.cli import app
from llmbatch.dispatcher.errors import KafkaAuthenticationFailed, KafkaNotAuthorized, classify
from llmbatch.dispatcher.security.kafka_acl import ROLES, AclBinding, Role, acl_bindings, render, role_grants
from llmbatch.schemas.batch import CancelRequest
from llmbatch.schemas.cloudevents import Envelope
from llmbatch.settings import KafkaSettings, TopicSettings
from llmbatch.stack.kafka_broker import KafkaSasl, _kafka_properties
from llmbatch.stack.process import StackError

pytestmark = pytest.mark.unit

TOPICS = TopicSettings(requests="t.req", results="t.res", dead_letter="t.dlt")


def _grants(role: Role, topics: TopicSettings = TOPICS, group: str = "g1") -> set[tuple[str, str, str]]:
    return {(g.resource_type, g.resource_name, g.operation) for g in role_grants(topics, group)[role]}


def test_each_role_gets_exactly_what_its_code_uses() -> None:
    assert _grants("producer") == {
        ("TOPIC", "t.req", "WRITE"),
        ("TOPIC", "t.req", "DESCRIBE"),
        ("TOPIC", "t.res", "READ"),
        ("TOPIC", "t.res", "DESCRIBE"),
    }
    assert _grants("dispatcher") == {
        ("TOPIC", "t.req", "READ"),
        ("TOPIC", "t.req", "DESCRIBE"),
        ("TOPIC", "t.req", "DESCRIBE_CONFIGS"),
        ("GROUP", "g1", "READ"),
        ("TOPIC", "t.res", "WRITE"),
        ("TOPIC", "t.res", "READ"),
        ("TOPIC", "t.res", "DESCRIBE"),
        ("TOPIC", "t.res", "DESCRIBE_CONFIGS"),
        ("TOPIC", "t.dlt", "WRITE"),
        ("TOPIC", "t.dlt", "DESCRIBE"),
        ("TOPIC", "t.dlt", "DESCRIBE_CONFIGS"),
    }
    assert _grants("operator") == {
        ("TOPIC", "t.dlt", "READ"),
        ("TOPIC", "t.dlt", "DESCRIBE"),
        ("TOPIC", "t.req", "WRITE"),
        ("TOPIC", "t.req", "DESCRIBE"),
    }


def test_the_promises_of_least_privilege_hold_for_any_names() -> None:
    topics = TopicSettings(requests="a", results="b", dead_letter="c")
    bindings = acl_bindings(topics, "grp")
    by = {(b.role, b.resource_name, b.operation) for b in bindings}
    # only the dispatcher reads requests; only it writes results and dead letters
    assert {r for r, name, op in by if name == "a" and op == "READ"} == {"dispatcher"}
    assert {r for r, name, op in by if name in {"b", "c"} and op == "WRITE"} == {"dispatcher"}
    # nothing on the cluster, no Create, no wildcard or prefixed pattern, only ALLOW from any host
    assert all(
        b.resource_type != "CLUSTER" and b.operation not in {"CREATE", "IDEMPOTENT_WRITE"} for b in bindings
    )
    assert all(b.pattern_type == "LITERAL" and b.permission == "ALLOW" and b.host == "*" for b in bindings)
    assert {b.resource_name for b in bindings} == {"a", "b", "c", "grp"}
    assert {b.principal for b in bindings} == {f"User:{r}" for r in ROLES}


def test_users_per_role_and_one_user_in_two_roles_gets_each_binding_once() -> None:
    bindings = acl_bindings(TOPICS, "g1", {"producer": ["api", "batch-svc"], "operator": ["api"]})
    principals = {b.principal for b in bindings}
    assert principals == {"User:api", "User:batch-svc", "User:dispatcher"}
    api = [b.key() for b in bindings if b.principal == "User:api"]
    assert len(api) == len(set(api))
    # producer and operator both write and describe the requests topic: once each for api
    assert sum(1 for b in bindings if b.principal == "User:api" and b.resource_name == "t.req") == 2


@pytest.mark.parametrize(
    ("topics", "group", "users", "message"),
    [
        (TopicSettings(requests="*"), "g", None, "requests topic is named '\\*'"),
        (TOPICS, "*", None, "consumer group is named '\\*'"),
        (TOPICS, "g", {"admin": ["x"]}, "unknown Kafka role 'admin'"),
        (TOPICS, "g", {"producer": []}, "producer role has no user"),
        (TOPICS, "g", {"producer": ["a,b"]}, "Kafka user name 'a,b'"),
        (TOPICS, "g", {"producer": ["*"]}, "Kafka user name '\\*'"),
    ],
)
def test_wildcards_and_bad_names_are_refused(
    topics: TopicSettings, group: str, users: Any, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        acl_bindings(topics, group, users)


def test_render_lists_each_role_with_its_reasons() -> None:
    text = render(acl_bindings(TOPICS, "g1"))
    assert text.splitlines()[0] == "producer (User:producer)"
    assert "dispatcher (User:dispatcher)" in text and "operator (User:operator)" in text
    assert "ALLOW READ on GROUP g1" in text and "# join the consumer group" in text


def test_the_command_prints_text_or_json_and_names_a_bad_option(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LLMBATCH_KAFKA__TOPICS__RESULTS", "custom.results")
    monkeypatch.setenv("LLMBATCH_DISPATCHER__GROUP_ID", "custom-group")
    runner = CliRunner()
    assert runner.invoke(app, ["kafka-acl", "--help"]).exit_code == 0
    text = runner.invoke(app, ["kafka-acl"])
    assert text.exit_code == 0, text.output
    assert "ALLOW WRITE on TOPIC custom.results" in text.stdout and "GROUP custom-group" in text.stdout
    as_json = runner.invoke(app, ["kafka-acl", "--json", "--user", "producer=svc-a"])
    assert as_json.exit_code == 0, as_json.output
    bindings = [AclBinding.model_validate(b) for b in orjson.loads(as_json.stdout)]
    assert {b.principal for b in bindings if b.role == "producer"} == {"User:svc-a"}
    for args, says in (
        (["--user", "producer"], "--user takes ROLE=NAME"),
        (["--user", "admin=x"], "--user 'admin=x': unknown role 'admin'"),
        (["--user", "producer=a/b"], "--user 'producer=a/b': Kafka user name"),
        (["--apply"], "--apply needs the admin's credentials"),
    ):
        bad = runner.invoke(app, ["kafka-acl", *args])
        assert bad.exit_code == 2 and says in bad.output, bad.output
    unknown = runner.invoke(app, ["kafka-acl", "--bogus"])
    assert unknown.exit_code == 2 and "--bogus" in unknown.output


def test_the_test_broker_authorizes_every_client_and_keeps_passwords_valid() -> None:
    sasl = KafkaSasl("admin", {"admin": "pw-1", "producer": "pw.2"})
    sasl.check()
    props = "\n".join(_kafka_properties(Path("/d"), 9092, 9093, sasl, "ctlpw"))
    for line in (
        "authorizer.class.name=org.apache.kafka.metadata.authorizer.StandardAuthorizer",
        "allow.everyone.if.no.acl.found=false",
        "super.users=User:admin;User:kraft-controller",
        "listeners=SASL_PLAINTEXT://127.0.0.1:9092,CONTROLLER://127.0.0.1:9093",
        "sasl.enabled.mechanisms=SCRAM-SHA-512",
    ):
        assert line in props.splitlines()
    assert "ANONYMOUS" not in props and ":PLAINTEXT" not in props  # no listener without a login
    assert "pw.2" not in props  # only the broker's own (admin) login is in its properties
    plain = "\n".join(_kafka_properties(Path("/d"), 9092, 9093, None, "x"))
    assert "authorizer" not in plain and "PLAINTEXT://127.0.0.1:9092" in plain
    assert "pw-1" not in repr(sasl)
    for bad in (
        KafkaSasl("root", {"admin": "x"}),
        KafkaSasl("admin", {"admin": "has space"}),
        KafkaSasl("admin", {"admin": "x", "a]b": "y"}),
        KafkaSasl("admin", {"admin": 'q"'}),
    ):
        with pytest.raises(StackError):
            bad.check()


def test_refusals_are_not_retried_and_say_what_to_do() -> None:
    topic_refused = classify(TopicAuthorizationFailedError("t.res"))
    assert isinstance(topic_refused, KafkaNotAuthorized) and not topic_refused.retriable
    assert "t.res" in str(topic_refused) and "kafka-acl" in str(topic_refused)
    assert isinstance(classify(GroupAuthorizationFailedError("g")), KafkaNotAuthorized)
    login = classify(SaslAuthenticationFailed("invalid credentials"))
    assert isinstance(login, KafkaAuthenticationFailed) and not login.retriable
    assert classify(KafkaConnectionError("down")).retriable


class RefusingProducer:
    """aiokafka's producer for a topic the user may not write: send raises what aiokafka raises."""

    def __init__(self, **kwargs: Any) -> None:
        pass

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(self, topic: str, **kwargs: Any) -> Any:
        raise TopicAuthorizationFailedError(topic)


def test_a_publish_the_acls_refuse_is_not_authorized_naming_user_and_topic(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import aiokafka

    monkeypatch.setattr(aiokafka, "AIOKafkaProducer", RefusingProducer)
    kafka = KafkaSettings(
        security_protocol="SASL_PLAINTEXT",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="svc",
        sasl_password="secret-pw",
    )
    publisher = Publisher(kafka)
    envelope = Envelope.new(CancelRequest(batch_id="b1"), source="urn:t")
    with pytest.raises(NotAuthorized) as caught:
        asyncio.run(publisher.publish("t.res", envelope))
    assert not caught.value.retriable
    assert "user 'svc'" in str(caught.value) and "'t.res'" in str(caught.value)
    assert "secret-pw" not in str(caught.value)


def test_dlq_says_a_hidden_dead_letter_topic_may_be_forbidden_rather_than_missing() -> None:
    from llmbatch.dispatcher.ops.dlq_cli import _hidden
    from llmbatch.settings import LLMBatchSettings

    sasl = KafkaSettings(
        security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="ops", sasl_password="pw"
    )
    assert _hidden(LLMBatchSettings(kafka=sasl)) == " (or user 'ops' may not read it)"
    assert _hidden(LLMBatchSettings(kafka=KafkaSettings())) == ""
