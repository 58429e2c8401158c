"""The dispatcher with crash points armed, for the crash tests only:
``python -m tests.support.crashing_dispatcher POINT [POINT ...]`` runs ``llmbatch dispatcher run`` (same
settings, from the environment) with a crash hook that SIGKILLs this very process when it reaches one of
the points (kill -9 semantics: nothing flushed but the log). The points are the names the dispatcher
passes to its ``crash`` seam: after_accept, after_submit, after_job_end, after_publish, after_dlt."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Callable

from llmbatch.dispatcher.service import serve
from llmbatch.dispatcher.settings import DispatcherSettings

POINTS = frozenset({"after_accept", "after_submit", "after_job_end", "after_publish", "after_dlt"})
log = logging.getLogger("tests.crash")


def crash_hook(points: list[str]) -> Callable[[str], None]:
    """SIGKILL this very process when it reaches one of ``points``."""
    unknown = set(points) - POINTS
    if unknown:
        raise SystemExit(f"unknown crash points {sorted(unknown)}; known: {sorted(POINTS)}")
    armed = set(points)

    def crash(point: str) -> None:
        if point in armed:
            log.warning("crash point reached: SIGKILL", extra={"crash_point": point})
            for handler in logging.getLogger().handlers:
                with contextlib.suppress(Exception):
                    handler.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    return crash


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    hook = crash_hook(argv)
    return asyncio.run(serve(DispatcherSettings(), crash=hook))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
