"""The chaos runner's pure parts: when a run has drained, what marks a dead letter, the CLI."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace

import pytest

from llmbatch.chaos.__main__ import main
from llmbatch.chaos.readback import drained, marks
from llmbatch.chaos.verdict import Kind, Seen
from llmbatch.chaos.workload import workload

pytestmark = pytest.mark.unit


def test_a_run_has_drained_once_every_batch_ended_or_was_rejected_and_duplicates_answered() -> None:
    records = workload(batches=4, malformed=2, model="m", now=datetime.now(UTC), run="r")
    batches = [r.sent for r in records if r.sent.kind is Kind.BATCH]
    duplicates = [r.sent for r in records if r.sent.kind is Kind.DUPLICATE]
    assert batches and duplicates
    seen = [Seen("completed", s.batch_id or "", f"t-{s.batch_id}") for s in batches[1:]]
    seen.append(Seen("rejected", batches[0].batch_id or "", "x", request_id=batches[0].event_id))
    assert not drained(records, seen)  # the duplicates are not answered yet
    seen += [
        Seen("rejected", d.batch_id or "", f"y{i}", request_id=d.event_id) for i, d in enumerate(duplicates)
    ]
    assert drained(records, seen)
    assert not drained(records, seen[1:])  # a batch neither ended nor rejected


def test_dead_letters_are_marked_by_key_and_by_ce_id() -> None:
    records = [
        SimpleNamespace(key=b"k1", headers=[("ce_id", b"e1"), ("other", b"x")]),
        SimpleNamespace(key=None, headers=[("ce_id", b"e2")]),
    ]
    assert marks(records) == {"k1", "e1", "e2"}


def test_cli_help_and_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0 and "--short" in capsys.readouterr().out
    with pytest.raises(SystemExit) as info:
        main(["--faults", "dispatcher,gremlins"])
    assert info.value.code == 2 and "unknown fault 'gremlins'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--batches", "0"])
    assert info.value.code == 2 and "--batches must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:
        main(["--drain-timeout", "-5"])
    assert info.value.code == 2 and "--drain-timeout must be at least 0" in capsys.readouterr().err


def test_the_default_faults_follow_the_engine_path() -> None:
    from llmbatch.chaos.faults import FAULT_KINDS, default_faults

    one_broker = set(FAULT_KINDS) - {"kafka_leader"}
    assert set(default_faults(shared_engines=False)) == one_broker - {"runner", "runner_pause"}
    assert set(default_faults(shared_engines=True)) == one_broker - {"driver"}
    # a Kafka cluster: its partition leader is killed, not the stack's broker
    cluster = set(default_faults(shared_engines=True, kafka_brokers=3))
    assert cluster == set(FAULT_KINDS) - {"driver", "kafka"}


def test_the_job_side_clock_is_skewed_through_the_environment_jobs_and_the_runner_get() -> None:
    from llmbatch.chaos.run_settings import LIBFAKETIME, skewed_job_clock
    from llmbatch.dispatcher.backends.engines import engine_env_vars, runner_env_vars
    from llmbatch.dispatcher.settings import DispatcherSettings

    base = DispatcherSettings(_env_file=None)
    skewed = skewed_job_clock(base, 120)
    for env in (skewed.job.env_vars, runner_env_vars(skewed)):
        assert env["LD_PRELOAD"] == str(LIBFAKETIME) and env["FAKETIME"] == "+120s"
        # the monotonic clock moves with it (excluding it breaks time.sleep under libfaketime 0.9.10)
        assert "FAKETIME_DONT_FAKE_MONOTONIC" not in env
    assert "LD_PRELOAD" not in engine_env_vars(skewed)  # the engines keep the true time
