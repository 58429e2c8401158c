"""The chaos suite's checker (llmbatch.chaos.verdict): each broken promise is found, a clean run passes."""

from __future__ import annotations

import pytest

from llmbatch.chaos.verdict import Kind, Seen, Sent, judge

pytestmark = pytest.mark.unit
DONE = frozenset({"completed"})


def batch(n: int, expect: frozenset[str] = DONE) -> Sent:
    return Sent(Kind.BATCH, f"b{n}", f"e{n}", expect, custom_ids=(f"c{n}-0", f"c{n}-1"))


def clean_run() -> tuple[list[Sent], list[Seen], list[str], dict[str, list[str]]]:
    sent = [
        batch(1),
        batch(2, frozenset({"cancelled", "completed"})),
        Sent(Kind.DUPLICATE, "b1", "e1-dup"),
        Sent(Kind.MALFORMED, None, "m1", mark="junk-1"),
        Sent(Kind.CANCEL, "b2", "c-b2"),
    ]
    seen = [
        Seen("accepted", "b1", "a1"),
        Seen("accepted", "b2", "a2"),
        Seen("rejected", "b1", "r1", request_id="e1-dup"),
        Seen("completed", "b1", "t1"),
        Seen("completed", "b1", "t1"),  # a re-delivery: allowed
        Seen("cancelled", "b2", "t2"),
    ]
    return sent, seen, ["junk-1"], {"b1": ["c1-0", "c1-1"]}


def test_a_clean_run_keeps_every_promise() -> None:
    verdict = judge(*clean_run())
    assert verdict.ok, verdict.violations
    figures = verdict.figures
    assert (figures["accepted"], figures["ended completed"], figures["ended cancelled"]) == (2, 1, 1)
    assert figures["re-deliveries (same event id)"] == 1 and figures["lost (accepted, no terminal)"] == 0
    assert "violations" in verdict.table()


@pytest.mark.parametrize(
    ("break_it", "found"),
    [
        (lambda s, e, d, a: e.append(Seen("failed", "b1", "t1-other")), "b1: 2 distinct terminal event ids"),
        (lambda s, e, d, a: e.remove(Seen("cancelled", "b2", "t2")), "b2: accepted, no terminal event"),
        (lambda s, e, d, a: a.update({"b1": ["c1-0"]}), "custom_ids missing ['c1-1']"),
        (lambda s, e, d, a: a.update({"b1": ["c1-0", "c1-1", "c1-1"]}), "answered twice ['c1-1']"),
        (lambda s, e, d, a: d.clear(), "malformed record junk-1"),
        (
            lambda s, e, d, a: e.remove(Seen("rejected", "b1", "r1", request_id="e1-dup")),
            "duplicate request e1-dup",
        ),
        (lambda s, e, d, a: s.append(batch(3)), "b3: neither accepted nor rejected"),
        (
            lambda s, e, d, a: e.append(Seen("completed", "zz", "t9")),
            "zz: a terminal event for a batch nobody sent",
        ),
        # round two: a valid batch rejected or dead-lettered, two accepted ids for one lifecycle
        (
            lambda s, e, d, a: (s.append(batch(3)), e.append(Seen("rejected", "b3", "r3", request_id="e3"))),
            "b3: a valid batch was rejected",
        ),
        (lambda s, e, d, a: d.append("e2"), "b2: a valid batch was dead-lettered"),
        (
            lambda s, e, d, a: e.append(Seen("accepted", "b1", "a1-again")),
            "b1: 2 distinct accepted event ids",
        ),
    ],
)
def test_each_broken_promise_is_named(break_it: object, found: str) -> None:
    sent, seen, dead, answers = clean_run()
    break_it(sent, seen, dead, answers)  # type: ignore[operator]
    verdict = judge(sent, seen, dead, answers)
    assert not verdict.ok and any(found in v for v in verdict.violations), verdict.violations


def test_an_unexpected_status_is_named() -> None:
    sent, seen, dead, answers = clean_run()
    seen[seen.index(Seen("cancelled", "b2", "t2"))] = Seen("failed", "b2", "t2")
    verdict = judge(sent, seen, dead, answers)
    assert verdict.violations == ["b2: ended ['failed'], expected one of ['cancelled', 'completed']"]


def test_a_batch_may_be_rejected_only_when_the_workload_allows_it() -> None:
    """A deadline already past when the batch arrives: a rejection (and its dead letter) is an answer,
    not a broken promise; the dead letter of another record under the batch's key is not the batch's."""
    sent, seen, dead, answers = clean_run()
    sent.append(batch(4, frozenset({"expired", "completed", "rejected"})))
    seen.append(Seen("rejected", "b4", "r4", request_id="e4"))
    dead += ["e4", "b1"]  # b1: the key of its duplicate's dead letter
    assert judge(sent, seen, dead, answers).ok


@pytest.mark.parametrize(
    ("accepted_at", "ended_at", "late"),
    [
        (1000.0, 1100.0, False),  # 100 s past its deadline (1000): within the 120 s bound
        (1000.0, 1121.0, True),
        (1500.0, 1600.0, False),  # accepted after its deadline: the bound runs from acceptance
        (1000.0, None, True),  # never ended
    ],
)
def test_a_batch_ends_within_the_bound_after_its_deadline(
    accepted_at: float, ended_at: float | None, late: bool
) -> None:
    sent = [Sent(Kind.BATCH, "b5", "e5", frozenset({"expired", "completed"}), deadline=1000.0)]
    seen = [Seen("accepted", "b5", "a5", at=accepted_at)]
    if ended_at is not None:
        seen.append(Seen("expired", "b5", "t5", at=ended_at))
    verdict = judge(sent, seen, [], {}, deadline_bound_s=120.0)
    assert any("of its deadline" in v for v in verdict.violations) is late, verdict.violations
    assert verdict.figures["past deadline + bound"] == int(late)
