"""Admission of queued batches to the shared engines (pure rules of dispatcher.scheduler)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from llmbatch.dispatcher.domain.scheduler import Admission, EngineLoad, engine_capacity, window_requests
from llmbatch.dispatcher.settings import OWN_ENGINE_IN_FLIGHT, SHARED_IN_FLIGHT, DispatcherOptions
from llmbatch.schemas.engines import EngineModel
from llmbatch.schemas.job import EngineConfig

pytestmark = pytest.mark.unit


def test_a_batch_counts_its_window_or_what_it_has_left() -> None:
    assert window_requests(10, 0, 256) == 10  # a small batch: all of it
    assert window_requests(1000, 0, 256) == 256  # a big one: the requests it sends at once
    assert window_requests(1000, 900, 256) == 100  # near its end: what is left
    assert window_requests(1000, 1000, 256) == 0
    assert window_requests(None, 0, 256) == 256  # a file not counted yet: a whole window


def test_the_window_is_what_a_batch_alone_keeps_at_a_replica() -> None:
    # twice what the replica's engine runs at once (schemas.engines.call_rows: running and waiting) ...
    entry = EngineModel(path="m", engine=EngineConfig(batch_size=16, batches_in_flight=3))
    assert entry.batch_window == 2 * entry.max_active_requests == 512
    # ... never less than batch_size x batches_in_flight
    small = EngineModel(
        path="m", engine=EngineConfig(batch_size=16, batches_in_flight=3), max_active_requests=8
    )
    assert small.batch_window == 48
    assert EngineModel(path="m").admit_per_replica == 1024


def test_capacity_follows_the_replicas_that_run() -> None:
    assert engine_capacity(100, live_replicas=None, min_replicas=0, max_replicas=4) == 100  # from zero
    assert engine_capacity(100, live_replicas=3, min_replicas=0, max_replicas=4) == 300
    assert engine_capacity(100, live_replicas=None, min_replicas=2, max_replicas=4) == 200
    assert engine_capacity(100, live_replicas=9, min_replicas=0, max_replicas=4) == 400  # stale series


def test_small_batches_are_admitted_until_the_replicas_are_full() -> None:
    admission = Admission.of({"m": 100}, [])
    admitted = [admission.admit("m", 0, 8) for _ in range(20)]
    assert admitted == [True] * 12 + [False] * 8  # 12 x 8 = 96 fits, a 13th would make 104
    assert admission.requests("m") == 96 and admission.blocked == {"m"}


def test_a_batch_bigger_than_the_capacity_runs_alone() -> None:
    admission = Admission.of({"m": 100}, [])
    assert admission.admit("m", 0, 500) is True
    assert admission.admit("m", 0, 1) is False


def test_a_model_without_room_does_not_hold_back_another_model() -> None:
    admission = Admission.of({"a": 10, "b": 10}, [EngineLoad("a", 0, 10)])
    assert admission.admit("a", 0, 1) is False
    assert admission.admit("b", 0, 5) is True


def test_no_overtaking_within_a_model() -> None:
    # the big batch at the head does not fit; the small one behind it waits too (no starvation)
    admission = Admission.of({"m": 100}, [EngineLoad("m", 0, 60)])
    assert admission.admit("m", 0, 50) is False
    assert admission.admit("m", 0, 1) is False


def test_higher_priority_counts_only_work_of_its_rank() -> None:
    admission = Admission.of({"m": 100}, [EngineLoad("m", 0, 100), EngineLoad("m", 5, 30)])
    assert admission.ahead("m", 9) == 0 and admission.ahead("m", 5) == 30 and admission.ahead("m", 0) == 130
    assert admission.admit("m", 9, 8) is True  # the replicas run it first, taking p0 requests back
    assert admission.admit("m", 5, 70) is False  # 30 + 8 of rank >= 5 already
    assert admission.admit("m", 0, 1) is False  # blocked behind the p5 batch


def test_batches_that_run_as_ray_jobs_take_a_slot_and_the_short_path_goes_on_without() -> None:
    admission = Admission.of({"m": 1000}, [], job_slots=2)
    assert [admission.admit("m", 0, 8, job=True) for _ in range(3)] == [True, True, False]
    assert admission.job_slots == 0
    # a job without a slot holds back neither its model's short-path batches nor another model
    assert "m" not in admission.blocked
    assert admission.admit("m", 0, 8) is True and admission.admit("m", 0, 8, job=True) is False
    assert admission.requests("m") == 24  # the waiting job put nothing on the replicas
    # without a limit, jobs are admitted by the replicas' room alone
    free = Admission.of({"m": 1000}, [])
    assert all(free.admit("m", 0, 8, job=True) for _ in range(20)) and free.job_slots is None


def test_the_default_job_limit_is_a_few_drivers() -> None:
    assert DispatcherOptions().max_jobs_in_flight == 8


@given(
    capacity=st.integers(1, 2000),
    batches=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 600)), max_size=40),
)
def test_admitted_work_of_each_rank_fits_unless_it_ran_alone(
    capacity: int, batches: list[tuple[int, int]]
) -> None:
    ordered = sorted(batches, key=lambda b: -b[0])  # launch order: priority first
    admission = Admission.of({"m": capacity}, [])
    for priority, requests in ordered:
        before = admission.ahead("m", priority)
        if admission.admit("m", priority, requests):
            assert before == 0 or before + requests <= capacity
        else:
            assert "m" in admission.blocked


def test_max_in_flight_defaults_follow_the_engine_mode() -> None:
    assert DispatcherOptions().shared_engines  # the default: every batch on the warm, shared engines
    assert DispatcherOptions().launch_limit == SHARED_IN_FLIGHT
    assert DispatcherOptions(shared_engines=False).launch_limit == OWN_ENGINE_IN_FLIGHT
    assert DispatcherOptions(shared_engines=True, max_in_flight=3).launch_limit == 3


def test_a_heartbeat_interval_near_the_timeout_is_refused_naming_both_variables() -> None:
    from llmbatch.dispatcher.settings_loader import SettingsInvalid, load_settings

    with pytest.raises(SettingsInvalid) as info:
        load_settings(_env_file=None, job={"progress_interval_s": 100})
    line = str(info.value)
    assert line.startswith("invalid settings: LLMBATCH_JOB__PROGRESS_INTERVAL_S (100)")
    assert "LLMBATCH_DISPATCHER__HEARTBEAT_TIMEOUT_S (180)" in line
    settings = load_settings(_env_file=None, job={"progress_interval_s": 60})  # a third: accepted
    assert settings.job.progress_interval_s == 60


def test_a_tenant_with_nothing_at_the_engines_gets_its_first_batch_in_when_another_fills_them() -> None:
    full = Admission.of({"m": 100}, [EngineLoad("m", 5, 100, "many")])
    assert not full.admit("m", 5, 20, tenant="many")  # over capacity: the model is held back
    assert full.admit("m", 5, 20, tenant="lone")  # but not a tenant's first batch of its rank
    assert not full.admit("m", 5, 20, tenant="lone")  # its second waits like the others
    assert full.admit("m", 5, 20, tenant="third")


def test_one_tenant_is_admitted_as_before_the_tenants_rule() -> None:
    """With every batch the default tenant's, the rule changes nothing: a first of its rank is admitted
    only when nothing of that rank runs (as before)."""
    loads = [EngineLoad("m", 5, 90)]
    admission = Admission.of({"m": 100}, loads)
    assert admission.admit("m", 5, 10)  # fits exactly
    assert not admission.admit("m", 5, 1)  # the model is full for priority 5
    assert not admission.admit("m", 9, 1)  # held back in this pass, as before
