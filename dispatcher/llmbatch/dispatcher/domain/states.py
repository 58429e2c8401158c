"""Batch lifecycle: the states (``llmbatch.schemas.common.BatchStatus``) and which transitions are allowed.

Pure: no I/O. The Redis store checks every transition against :data:`ALLOWED` before it sends the
compare-and-set script, and the script checks the ``from`` state again atomically.

::

    (new) ──intake──► queued ──launch──► submitted ──► running ──► finalizing ──► completed
                        ▲                    │            │            │
                        └──── retry ◄────────┴────────────┴────────────┘
    any non-terminal ──► failed | cancelled | expired
    (new) ──invalid event with a readable batch_id──► dead_lettered
    failed | dead_lettered ──operator replay──► accepted ──► queued

``accepted`` is the acceptance instant: intake records it and moves the batch to ``queued`` in the
same atomic step (a replayed batch passes through it the same way).
"""

from __future__ import annotations

from collections.abc import Iterable

from llmbatch.schemas.common import TERMINAL_STATUSES, BatchStatus
from llmbatch.schemas.errors import LLMBatchError

State = BatchStatus

TERMINAL: frozenset[State] = frozenset(TERMINAL_STATUSES)
NON_TERMINAL: frozenset[State] = frozenset(s for s in State if s not in TERMINAL)
#: States in which a Ray job may exist for the current attempt (they count against max_in_flight).
IN_FLIGHT: frozenset[State] = frozenset({State.SUBMITTED, State.RUNNING, State.FINALIZING})
#: Terminal states a replayed event may bring back to life (those that wrote a dead-letter record).
REPLAYABLE: frozenset[State] = frozenset({State.FAILED, State.DEAD_LETTERED})

_ENDINGS = {State.FAILED, State.CANCELLED, State.EXPIRED}

ALLOWED: dict[State, frozenset[State]] = {
    State.ACCEPTED: frozenset({State.QUEUED, *_ENDINGS}),
    State.QUEUED: frozenset({State.SUBMITTED, *_ENDINGS}),
    State.SUBMITTED: frozenset({State.RUNNING, State.FINALIZING, State.QUEUED, *_ENDINGS}),
    State.RUNNING: frozenset({State.FINALIZING, State.QUEUED, *_ENDINGS}),
    # the job has finished its work (the tracker lets a late cancel or deadline pass); its manifest
    # may still report cancelled/expired when the job itself stopped early
    State.FINALIZING: frozenset({State.COMPLETED, State.QUEUED, *_ENDINGS}),
    State.COMPLETED: frozenset(),
    State.FAILED: frozenset({State.ACCEPTED}),
    State.CANCELLED: frozenset(),
    State.EXPIRED: frozenset(),
    State.DEAD_LETTERED: frozenset({State.ACCEPTED}),
}

#: The first state of a batch created by intake, and of one rejected at intake.
INITIAL: frozenset[State] = frozenset({State.QUEUED, State.DEAD_LETTERED})


class TransitionError(LLMBatchError, ValueError):
    """A transition the lifecycle does not allow (a programming error, never retried)."""


def can_transition(src: State | None, dst: State) -> bool:
    """Whether ``src -> dst`` is allowed; ``src=None`` means the batch does not exist yet."""
    if src is None:
        return dst in INITIAL
    return dst in ALLOWED[State(src)]


def sources_of(dst: State) -> frozenset[State]:
    """Every state from which ``dst`` may be entered."""
    return frozenset(src for src, dsts in ALLOWED.items() if dst in dsts)


def check_transition(src: State | None, dst: State) -> None:
    if not can_transition(src, dst):
        raise TransitionError(f"transition {src.value if src else '(new)'} -> {dst.value} is not allowed")


def is_terminal(state: State | str) -> bool:
    return State(state) in TERMINAL


def terminal_event_state(state: State) -> State:
    """The state named by the terminal event: a batch dead-lettered at intake reports ``failed``."""
    if state not in TERMINAL:
        raise TransitionError(f"{state.value} is not terminal")
    return State.FAILED if state is State.DEAD_LETTERED else state


def parse_states(values: Iterable[str]) -> list[State]:
    return [State(v) for v in values]
