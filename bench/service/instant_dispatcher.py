"""A dispatcher process on the :class:`~bench.service.instant_backend.InstantBackend` (no Ray): the
service of ``llmbatch dispatcher run`` with every attempt run at once in this process. Settings from
the environment as the service takes them. Every second it writes the attempts' own CPU seconds and
count to the JSON file named by its first argument; the folder named by the second, if given, is shared
with the other dispatcher processes of the run (attempts run where their batch is tracked: see
:class:`~bench.service.instant_backend.InstantBackend`). Run by ``bench/bench_dispatcher_load.py``; not
a test.

    python bench/service/instant_dispatcher.py ATTEMPT_CPU_JSON [SHARED_FOLDER]
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.service.instant_backend import InstantBackend  # noqa: E402


async def main(report: Path, shared: Path | None) -> int:
    from llmbatch.dispatcher import logs
    from llmbatch.dispatcher.service import Dispatcher
    from llmbatch.dispatcher.settings import DispatcherSettings

    settings = DispatcherSettings()
    logs.setup(settings.dispatcher.log_level, settings.dispatcher.log_json)
    backend = InstantBackend(shared=shared)
    dispatcher = Dispatcher(settings, backend=backend)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, dispatcher.request_stop)

    def write() -> None:  # a few bytes to a local file: not worth a thread
        report.write_text(json.dumps({"cpu_s": backend.attempt_cpu_s, "attempts": backend.attempts}))

    async def account() -> None:
        while True:
            write()
            await asyncio.sleep(1.0)

    accounting = asyncio.create_task(account())
    try:
        await dispatcher.start()
        await dispatcher.wait()
    finally:
        accounting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await accounting
        await dispatcher.stop()
        write()
    return 0


if __name__ == "__main__":
    if len(sys.argv) not in (2, 3) or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        sys.exit(0 if len(sys.argv) == 2 else 2)
    sys.exit(asyncio.run(main(Path(sys.argv[1]), Path(sys.argv[2]) if len(sys.argv) == 3 else None)))
