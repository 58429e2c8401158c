"""The chaos suite's checker: what was sent, what came out, and every broken promise. Pure.

In the style of Jepsen's and Kafka's verifiable clients: unique batch ids go in, and afterwards the
results topic, the dead-letter topic and the result files are read back whole. The promises checked:

- every accepted batch has exactly one distinct terminal event id (re-deliveries of the same id are
  counted apart, they are allowed);
- its terminal status is one the workload allows for it;
- a completed batch answers each of its custom_ids exactly once (outputs and errors together);
- every request that names a batch id is answered: accepted, or rejected (a duplicate's new event id);
- every malformed record is on the dead-letter topic or answered with a rejection;
- nothing is stuck: no accepted batch without a terminal event;
- a valid batch is never rejected (unless the workload allows it: a deadline already past when it
  arrives) and never dead-lettered, and gets one ``accepted`` event id;
- a batch with a deadline ends within ``deadline_bound_s`` of it (of its acceptance, when it was
  accepted after its deadline), by the events' own times.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class Kind(StrEnum):
    """What the workload sent."""

    BATCH = "batch"  # a valid request under a new batch id
    DUPLICATE = "duplicate"  # the same batch id again under a new event id (answered, never run twice)
    MALFORMED = "malformed"  # must land on the dead-letter topic (or be answered, when it names a batch)
    CANCEL = "cancel"  # a cancel of an earlier batch


@dataclass(frozen=True)
class Sent:
    """One record the workload sent. ``expect``: the terminal statuses allowed for a ``BATCH``
    (``completed``, ``failed``, ``cancelled``, ``expired``); ``custom_ids``: what a completed batch must
    answer; ``mark``: what identifies a malformed record on the dead-letter topic (its key or ce_id)."""

    kind: Kind
    batch_id: str | None
    event_id: str | None
    expect: frozenset[str] = frozenset()
    custom_ids: tuple[str, ...] = ()
    mark: str | None = None
    deadline: float | None = None  # unix seconds


@dataclass(frozen=True)
class Seen:
    """One result event read back: ``status`` is ``accepted``, ``rejected`` or a terminal status;
    ``request_id`` the ``ce_id`` a rejection answers."""

    status: str
    batch_id: str
    event_id: str
    request_id: str | None = None
    at: float | None = None  # the event's time (unix seconds)


TERMINAL = frozenset({"completed", "failed", "cancelled", "expired"})


@dataclass
class Verdict:
    """Figures for the table and the violations (empty: the run kept every promise)."""

    figures: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.violations

    def table(self) -> str:
        width = max((len(k) for k in self.figures), default=0)
        lines = [f"{name:<{width}}  {value:>8}" for name, value in self.figures.items()]
        lines.append(f"{'violations':<{width}}  {len(self.violations):>8}")
        return "\n".join([*lines, *(f"  - {v}" for v in self.violations[:50])])


def judge(
    sent: Iterable[Sent],
    seen: Iterable[Seen],
    dead_letter_marks: Iterable[str],
    answers: Mapping[str, Iterable[str]],
    *,
    deadline_bound_s: float = 120.0,
) -> Verdict:
    """The verdict of one run. ``dead_letter_marks``: the key or ce_id of every dead letter;
    ``answers``: batch id -> the custom_ids of its output and error lines (completed batches);
    ``deadline_bound_s``: how long past its deadline a batch may take to end (the stop wait, a poll)."""
    sent = list(sent)
    terminals: dict[str, set[str]] = defaultdict(set)
    terminal_status: dict[str, set[str]] = defaultdict(set)
    accepted: set[str] = set()
    accepted_ids: dict[str, set[str]] = defaultdict(set)
    accepted_at: dict[str, float] = {}
    ended_at: dict[str, float] = {}
    rejected_requests: set[str] = set()
    redelivered = 0
    seen_ids: Counter[str] = Counter()
    for event in seen:
        seen_ids[event.event_id] += 1
        if seen_ids[event.event_id] > 1:
            redelivered += 1
            continue
        if event.status == "accepted":
            accepted.add(event.batch_id)
            accepted_ids[event.batch_id].add(event.event_id)
            if event.at is not None:
                accepted_at[event.batch_id] = min(event.at, accepted_at.get(event.batch_id, event.at))
        elif event.status == "rejected":
            if event.request_id:
                rejected_requests.add(event.request_id)
        elif event.status in TERMINAL:
            terminals[event.batch_id].add(event.event_id)
            terminal_status[event.batch_id].add(event.status)
            if event.at is not None:
                ended_at[event.batch_id] = max(event.at, ended_at.get(event.batch_id, event.at))
    marks = set(dead_letter_marks)
    verdict = Verdict()
    v = verdict.violations
    batches = [s for s in sent if s.kind is Kind.BATCH]
    late = 0
    for s in batches:
        assert s.batch_id is not None
        # by its own event id: a duplicate or a cancel under the same key is dead-lettered on its own;
        # a batch whose deadline passed before it arrived is dead-lettered (deadline_passed) and rejected
        if s.event_id in marks and "rejected" not in s.expect:
            v.append(f"{s.batch_id}: a valid batch was dead-lettered")
        if s.batch_id not in accepted:
            if s.event_id not in rejected_requests:
                v.append(f"{s.batch_id}: neither accepted nor rejected")
            elif "rejected" not in s.expect:
                v.append(f"{s.batch_id}: a valid batch was rejected")
            continue
        if len(accepted_ids[s.batch_id]) > 1:
            v.append(f"{s.batch_id}: {len(accepted_ids[s.batch_id])} distinct accepted event ids")
        ids = terminals.get(s.batch_id, set())
        if s.deadline is not None and s.batch_id in accepted_at:
            bound = max(s.deadline, accepted_at[s.batch_id]) + deadline_bound_s
            if ended_at.get(s.batch_id, float("inf")) > bound:
                late += 1
                v.append(f"{s.batch_id}: no terminal event within {deadline_bound_s:g} s of its deadline")
        if not ids:
            v.append(f"{s.batch_id}: accepted, no terminal event (stuck or lost)")
            continue
        if len(ids) > 1:
            v.append(f"{s.batch_id}: {len(ids)} distinct terminal event ids")
        statuses = terminal_status[s.batch_id]
        if s.expect and not statuses <= s.expect:
            v.append(f"{s.batch_id}: ended {sorted(statuses)}, expected one of {sorted(s.expect)}")
        if statuses == {"completed"} and s.custom_ids:
            got = Counter(answers.get(s.batch_id, ()))
            missing = [c for c in s.custom_ids if got[c] == 0]
            twice = sorted(c for c, n in got.items() if n > 1)
            extra = sorted(set(got) - set(s.custom_ids))
            if missing or twice or extra:
                v.append(
                    f"{s.batch_id}: custom_ids missing {missing[:5]}, answered twice {twice[:5]}, "
                    f"unknown {extra[:5]}"
                )
    for s in sent:
        if s.kind is Kind.DUPLICATE and s.event_id not in rejected_requests:
            v.append(f"{s.batch_id}: the duplicate request {s.event_id} was not answered")
        if s.kind is Kind.MALFORMED and s.mark not in marks and s.event_id not in rejected_requests:
            v.append(f"malformed record {s.mark or s.event_id}: not on the dead-letter topic, not answered")
    sent_ids = {s.batch_id for s in batches}
    for batch_id in sorted(set(terminals) - sent_ids - {s.batch_id for s in sent if s.batch_id}):
        v.append(f"{batch_id}: a terminal event for a batch nobody sent")
    by_status = Counter(next(iter(st)) for st in terminal_status.values() if len(st) == 1)
    verdict.figures = {
        "batches sent": len(batches),
        "duplicates sent": sum(1 for s in sent if s.kind is Kind.DUPLICATE),
        "malformed sent": sum(1 for s in sent if s.kind is Kind.MALFORMED),
        "cancels sent": sum(1 for s in sent if s.kind is Kind.CANCEL),
        "accepted": len(accepted),
        "rejected answers": len(rejected_requests),
        **{f"ended {name}": by_status.get(name, 0) for name in sorted(TERMINAL)},
        "re-deliveries (same event id)": redelivered,
        "dead letters": len(marks),
        "past deadline + bound": late,
        "lost (accepted, no terminal)": sum(
            1 for s in batches if s.batch_id in accepted and not terminals.get(s.batch_id or "")
        ),
    }
    return verdict
