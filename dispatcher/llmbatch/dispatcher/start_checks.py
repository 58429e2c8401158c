"""What the dispatcher checks once as it starts, and says of it: settings it cannot serve with (it
refuses to start), the trust the settings leave open (replays and tenants taken from any producer),
the topics (created when missing, sizes that would refuse what the settings accept) and how durable
Redis keeps acknowledged intakes.
"""

from __future__ import annotations

import contextlib
import logging

from llmbatch.dispatcher.errors import DispatcherError, KafkaUnavailable
from llmbatch.dispatcher.settings import DispatcherSettings
from llmbatch.dispatcher.state.store import StateStore

log = logging.getLogger(__name__)


def start_problem(settings: DispatcherSettings, *, short_path: bool) -> str | None:
    """Why the dispatcher cannot serve with ``settings`` (None: it can); ``short_path``: whether it
    routes small batches to the batch runner, which needs the runner's token."""
    problem = settings.serving_problem()
    if problem is None and short_path and settings.ray.runner_token is None:
        problem = (
            "the short path is on (LLMBATCH_DISPATCHER__SHORT_PATH_MAX_LINES > 0) but "
            "LLMBATCH_RAY__RUNNER_TOKEN is not set: give the dispatcher and the Ray nodes the same "
            "token (on Kubernetes the llmbatch-credentials Secret's runner-token), or set "
            "LLMBATCH_DISPATCHER__SHORT_PATH_MAX_LINES=0"
        )
    return problem


def say_trust(settings: DispatcherSettings) -> None:
    """Log what the settings trust: replay headers and tenants from any producer that may write the
    requests topic when their keys are not set, and the tenants whose jobs run on their own pools."""
    if settings.replay.key is None:
        log.warning(
            "LLMBATCH_REPLAY__KEY is not set: replay headers are honoured from any producer "
            "that may write the requests topic (they reopen failed batches)"
        )
    if not settings.tenants.keys:
        log.warning(
            "LLMBATCH_TENANTS__KEYS is not set: the tenant a request or cancel names is trusted "
            "from any producer that may write the requests topic"
        )
    else:
        log.info(
            "requests and cancels must be signed by their tenant",
            extra={"tenants": sorted(settings.tenants.keys)},
        )
    if settings.tenants.pools:
        log.info(
            "these tenants' jobs run only on their own worker pools (Ray resource "
            "llmbatch_tenant_<tenant>), never on the shared batch runner",
            extra={"tenants": settings.tenants.pools},
        )


async def check_durability(store: StateStore) -> None:
    """Say once when Redis may lose acknowledged intakes in a crash (see dispatcher.reconcile)."""
    with contextlib.suppress(DispatcherError):
        policy = await store.fsync_policy()
        if policy is not None and policy != "always":
            log.warning(
                "Redis runs with appendfsync %s: a crash of its host may lose the last second of "
                "accepted batches (the reconcile pass takes them in again from the requests topic); "
                "run Redis with --appendfsync always for durable intake",
                policy,
            )


async def prepare_topics(settings: DispatcherSettings) -> None:
    """Create the topics that are missing (a failure raises
    :class:`~llmbatch.dispatcher.errors.KafkaUnavailable`), then :func:`say_topic_sizes`."""
    from llmbatch.adapters.topics import ensure_topics

    try:
        created = await ensure_topics(settings)
    except Exception as exc:
        raise KafkaUnavailable(str(exc)) from exc
    if created:
        log.info("topics created", extra={"topics": created})
    await say_topic_sizes(settings)


async def say_topic_sizes(settings: DispatcherSettings) -> None:
    """Warn once at start about existing topics that would refuse what the settings accept."""
    from llmbatch.adapters.topics import check_topic_sizes

    try:
        problems = await check_topic_sizes(settings)
    except Exception as exc:  # a broker that will not describe configs (ACLs) is not an outage
        log.info("topic sizes not checked", extra={"error": str(exc)[:300]})
        return
    for problem in problems:
        log.warning(problem)
