"""The order in which a shared engine takes requests of many batches (pure, no engine, no Ray).

- **Priority first**: a request of a higher priority is always taken before one of a lower.
- **Fair among equals, tenants first**: within a priority, tenants take turns by weight (a tenant of
  weight 2 takes two turns for one of weight 1; stride scheduling: the tenant that has used least of
  its share goes next, and a tenant that starts waiting joins at the others' level, without credit for
  the time it was away); inside a tenant's turns its batches take turns, one request per turn. So a
  10-line batch is not stuck behind the 100,000 lines of a batch that arrived first, and one tenant's
  500 batches take one tenant's share, not 500 batches' shares. A batch's tenant is what its group
  name says before a ``/`` (``<tenant>/<batch_id>``, :attr:`llmbatch.schemas.job.JobSpec.engine_group`);
  a group without one is a tenant of its own.
- **Urgent deadlines first**: a batch whose caller says it is urgent (near its deadline or behind it at
  its rate so far: a ``due`` time with its requests, :func:`llmbatch.schemas.deadlines.urgent`) goes
  before the batches of its priority taking turns, the earliest due first (EDF among the urgent). A
  later call without ``due`` puts it back in turn.
- **Shared prefixes together**: inside a batch, requests are taken in the order of their prompt
  tokens, so requests that share a prompt prefix (a system prompt) reach the engine one after
  the other and hit its prefix cache while the prefix is still there.

A request taken back from the engine (preempted by higher-priority work) goes to the front of
its batch's queue.
"""

from __future__ import annotations

import bisect
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

T = TypeVar("T")

# prompts are ordered by their first tokens only: enough to put a shared system prompt together
ORDER_TOKENS = 512


@dataclass(order=True)
class _Entry(Generic[T]):
    sort_key: tuple[int, ...]
    seq: int
    item: T = field(compare=False)


class _Group(Generic[T]):
    """One batch's waiting requests, sorted by prompt tokens (then arrival)."""

    def __init__(self, priority: int) -> None:
        self.priority = priority
        self.entries: list[_Entry[T]] = []
        self.front: list[T] = []  # taken back from the engine: first out, in their old order

    def __len__(self) -> int:
        return len(self.entries) + len(self.front)

    def pop(self) -> T:
        if self.front:
            return self.front.pop(0)
        return self.entries.pop(0).item


class _Tenant(Generic[T]):
    """One tenant's waiting batches of one priority, in turn order, and its place in the tenants' turns."""

    def __init__(self, pass_: float, order: int) -> None:
        self.groups: OrderedDict[str, _Group[T]] = OrderedDict()
        self.pass_ = pass_  # share used so far: turns taken / weight (the least goes next)
        self.order = order  # when it last took a turn (or joined): ties go to the longest waiting


def tenant_of(group: str) -> str:
    """The tenant a group name (``<tenant>/<batch_id>``) belongs to; a name without ``/`` is its own."""
    tenant, sep, _ = group.partition("/")
    return tenant if sep else group


class FairQueue(Generic[T]):
    """Waiting requests of many batches (``group``), taken by priority, then in turns (tenants by
    ``weights``, 1 for a tenant not named, then their batches), then prefix."""

    def __init__(self, weights: Mapping[str, float] | None = None) -> None:
        self._weights = {t: w for t, w in (weights or {}).items() if w > 0}
        # priority -> tenant -> its groups of that priority in turn order
        self._turns: dict[int, dict[str, _Tenant[T]]] = {}
        self._groups: dict[str, _Group[T]] = {}
        self._order = 0
        # priority -> the urgent groups of that priority and their due times (the only record of them)
        self._due: dict[int, dict[str, float]] = {}
        self._seq = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def push(
        self,
        group: str,
        priority: int,
        item: T,
        prompt: list[int] | tuple[int, ...] = (),
        due: float | None = None,
    ) -> None:
        """Queue ``item`` of batch ``group``; ``prompt`` (token ids) orders it inside the batch; ``due``
        (the batch's deadline, given while it is urgent) puts the batch ahead of its
        priority's turns, the earliest first.

        A batch keeps the priority it was first queued with while any of its requests wait."""
        found = self._group(group, priority)
        self._set_due(group, found, due)
        self._seq += 1
        bisect.insort(found.entries, _Entry(tuple(prompt[:ORDER_TOKENS]), self._seq, item))
        self._size += 1

    def push_front(self, group: str, priority: int, item: T) -> None:
        """Give back ``item`` (taken earlier, not finished): it is the batch's next request."""
        found = self._group(group, priority)
        found.front.append(item)
        self._size += 1

    def at_risk_waiting(self) -> int:
        """Requests waiting of the urgent batches (read without a lock from another thread: a figure,
        possibly a step old)."""
        groups = [self._groups.get(name) for at_risk in list(self._due.values()) for name in list(at_risk)]
        return sum(len(g) for g in groups if g is not None)

    def top_priority(self) -> int | None:
        """The highest priority waiting, or None when nothing waits."""
        return max(self._turns) if self._turns else None

    def pop(self) -> tuple[str, int, T] | None:
        """The next request ``(group, priority, item)``, or None when nothing waits."""
        priority = self.top_priority()
        if priority is None:
            return None
        tenants = self._turns[priority]
        at_risk = self._due.get(priority)
        if at_risk:  # EDF among the batches at risk; the others keep their turns
            name = min(at_risk, key=at_risk.__getitem__)
            tenant_name = tenant_of(name)
            tenant = tenants[tenant_name]
        else:
            tenant_name, tenant = min(tenants.items(), key=lambda t: (t[1].pass_, t[1].order))
            name = next(iter(tenant.groups))
        group = tenant.groups[name]
        item = group.pop()
        self._size -= 1
        tenant.pass_ += 1 / self._weights.get(tenant_name, 1.0)
        self._order += 1
        tenant.order = self._order
        if group:
            if not at_risk:
                tenant.groups.move_to_end(name)  # the tenant's next batch takes its next turn
        else:
            self._forget(name, group)
        return name, priority, item

    def remove(self, match: Callable[[T], bool]) -> list[T]:
        """Remove and return the waiting items ``match`` selects (a call whose caller stopped waiting);
        the others keep their places and the tenants their shares."""
        removed: list[T] = []
        for name, group in list(self._groups.items()):
            front: list[T] = []
            entries: list[_Entry[T]] = []
            for item in group.front:
                (removed if match(item) else front).append(item)
            for entry in group.entries:
                if match(entry.item):
                    removed.append(entry.item)
                else:
                    entries.append(entry)  # still sorted: a subsequence of a sorted list
            group.front, group.entries = front, entries
            if not group:
                self._forget(name, group)
        self._size -= len(removed)
        return removed

    def _forget(self, name: str, group: _Group[T]) -> None:
        """Drop batch ``name`` (nothing of it waits any more) from its tenant's and its priority's turns."""
        self._set_due(name, group, None)
        tenants = self._turns[group.priority]
        tenant_name = tenant_of(name)
        tenant = tenants[tenant_name]
        del tenant.groups[name]
        del self._groups[name]
        if not tenant.groups:
            del tenants[tenant_name]
            if not tenants:
                del self._turns[group.priority]

    def drain(self) -> list[T]:
        """Remove and return everything waiting (in no particular order)."""
        items = [item for g in self._groups.values() for item in (*g.front, *(e.item for e in g.entries))]
        self._turns.clear()
        self._groups.clear()
        self._due.clear()
        self._size = 0
        return items

    def _group(self, name: str, priority: int) -> _Group[T]:
        found = self._groups.get(name)
        if found is None:
            found = self._groups[name] = _Group(priority)
            tenants = self._turns.setdefault(priority, {})
            tenant = tenants.get(tenant_of(name))
            if tenant is None:  # joins at the level of the tenants waiting: no credit for time away
                self._order += 1
                level = min((t.pass_ for t in tenants.values()), default=0.0)
                tenant = tenants[tenant_of(name)] = _Tenant(level, self._order)
            tenant.groups[name] = found
        return found

    def _set_due(self, name: str, group: _Group[T], due: float | None) -> None:
        at_risk = self._due.setdefault(group.priority, {})
        if due is None:
            at_risk.pop(name, None)
        else:
            at_risk[name] = due
        if not at_risk:
            del self._due[group.priority]
