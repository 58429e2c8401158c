"""The order in which the launcher tries the batches ready to run (pure).

The ready queue orders batches by priority, then deadline. Taken as it is, a tenant that queued 50
batches before another tenant's one gets the engines' room 50 times first. Within a priority the
launcher takes tenants in turns instead: the next batch tried is one of the tenant with the fewest
batches in flight for its weight (``LLMBATCH_TENANTS__WEIGHTS``, 1 by default), counting those it is
about to launch; a tenant's own batches keep the queue's order (nearest deadline first). The engine
replicas share the same way (:mod:`llmbatch.ray_job.engines.fair_queue`).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence


def launch_order(
    candidates: Sequence[tuple[str, int]], in_flight: Mapping[str, int], weights: Mapping[str, float]
) -> list[int]:
    """Indexes of ``candidates`` (``(tenant, priority)``, in the ready queue's order) in the order to try
    them: higher priority first; within a priority, the tenant whose batches in flight (``in_flight``,
    plus its candidates of that priority ahead) are fewest per weight; then the queue's order."""
    ahead: Counter[tuple[str, int]] = Counter()  # a tenant's candidates of that priority before this one
    keys = []
    for index, (tenant, priority) in enumerate(candidates):
        turn = (in_flight.get(tenant, 0) + ahead[tenant, priority]) / weights.get(tenant, 1.0)
        ahead[tenant, priority] += 1
        keys.append((-priority, turn, index))
    return [index for _, _, index in sorted(keys)]
