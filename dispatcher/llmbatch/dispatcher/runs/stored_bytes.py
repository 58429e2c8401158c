"""``llmbatch_tenant_stored_bytes``: what each tenant keeps in the input and results buckets.

While this replica leads the tracker (one exporter, so sums over dispatcher pods stay right), every
``LLMBATCH_DISPATCHER__STORED_BYTES_EVERY_S`` it lists both buckets once and sets the gauge per tenant
and bucket: the configured tenants by name, every other folder summed as ``other`` (labels stay
bounded). Each tenant's total also goes to Redis (``<p>:stored:<tenant>``, kept three intervals): what
the intake and the HTTP API judge ``LLMBATCH_TENANTS__MAX_STORED_BYTES`` by. A listing reads every
object's entry (not its bytes): on buckets of many millions of objects, set the interval long, or 0 to
turn it off. An outage is logged once per change.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from llmbatch.adapters import storage
from llmbatch.dispatcher.metrics import Metrics
from llmbatch.settings import S3Settings

log = logging.getLogger(__name__)


class Leader(Protocol):
    @property
    def is_leader(self) -> bool: ...


class Figures(Protocol):
    """Where the totals go (:class:`~llmbatch.dispatcher.state.store.StateStore`)."""

    async def set_stored_bytes(self, sizes: Mapping[str, int], ttl_s: int) -> None: ...


def measure(s3: S3Settings, client: Any) -> dict[str, dict[str, int]]:
    """Bucket kind (``input``, ``results``) -> tenant folder -> bytes, from one listing of each bucket
    (blocking: run it in a thread)."""
    buckets = {"input": s3.input_bucket, "results": s3.results_bucket}
    return {kind: storage.folder_sizes(client, s3, bucket) for kind, bucket in buckets.items()}


def by_tenant(sizes: Mapping[str, int], known: frozenset[str]) -> dict[str, int]:
    """Folder sizes with the folders of tenants outside ``known`` summed as ``other`` (pure)."""
    out: dict[str, int] = {}
    for folder, size in sizes.items():
        label = folder if folder in known else "other"
        out[label] = out.get(label, 0) + size
    return out


class StoredBytes:
    """Exports the gauge while ``leader`` leads (see the module docstring)."""

    def __init__(
        self,
        s3: S3Settings,
        metrics: Metrics,
        leader: Leader,
        known: frozenset[str],
        stopping: asyncio.Event,
        *,
        every_s: float,
        figures: Figures | None = None,
        client_factory: Callable[[], Any] | None = None,
    ) -> None:
        self.s3 = s3
        self.metrics = metrics
        self.leader = leader
        self.known = known
        self.stopping = stopping
        self.every_s = every_s
        self.figures = figures
        self._client_factory = client_factory or (lambda: storage.make_client(s3))
        self._failing = False
        self.measures = 0
        """Listings tried (each one of both buckets)."""

    async def measure_once(self) -> None:
        """List both buckets once; set the gauge and (with ``figures``) the tenants' totals."""
        sizes = await asyncio.to_thread(lambda: measure(self.s3, self._client_factory()))
        self.metrics.set_stored_bytes({kind: by_tenant(per, self.known) for kind, per in sizes.items()})
        if self.figures is not None:
            totals: dict[str, int] = {}
            for per in sizes.values():
                for tenant, size in per.items():
                    totals[tenant] = totals.get(tenant, 0) + size
            await self.figures.set_stored_bytes(totals, int(max(3 * self.every_s, 600)))

    async def run(self) -> None:
        while not self.stopping.is_set():
            if self.leader.is_leader:
                self.measures += 1
                try:
                    await self.measure_once()
                except Exception as exc:  # an S3 outage must not end the task
                    if not self._failing:
                        log.warning("cannot measure the tenants' stored bytes: %s", exc)
                    self._failing = True
                else:
                    if self._failing:
                        log.info("the tenants' stored bytes are measured again")
                    self._failing = False
            else:
                self.metrics.set_stored_bytes({})
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), self.every_s)
