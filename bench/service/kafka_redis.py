"""A private Kafka and Redis for a bench that needs only those two (started in a temporary folder,
stopped by PID when the block ends, whatever happened in it)."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from llmbatch.stack import services
from llmbatch.stack.kafka_broker import start_kafka
from llmbatch.stack.process import stop_tree


@contextlib.contextmanager
def kafka_and_redis(prefix: str) -> Iterator[tuple[str, str]]:
    """``(Kafka bootstrap address, Redis URL)`` of a fresh broker and server."""
    run_dir = Path(tempfile.mkdtemp(prefix=prefix))
    redis_rec = services.start_redis(run_dir)
    kafka_rec = None
    try:
        kafka_rec = start_kafka(run_dir)
        yield kafka_rec.address, redis_rec.address
    finally:
        if kafka_rec is not None:
            stop_tree(kafka_rec.pid)
        stop_tree(redis_rec.pid)
