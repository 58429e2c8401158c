"""Stopping the dispatcher's producers when they never started (a dispatcher whose start was refused):
before, the two aiokafka producers were left unclosed and warned when collected."""

from __future__ import annotations

import gc
import warnings

import pytest

from llmbatch.dispatcher.kafka.publisher import EventProducer
from llmbatch.settings import KafkaSettings

pytestmark = pytest.mark.unit


async def test_producers_that_never_started_are_closed_by_stop() -> None:
    producer = EventProducer(KafkaSettings(bootstrap_servers="127.0.0.1:1"))
    await producer.stop()
    # only this dispatcher's two producers count: gc.collect() also finalizes what other tests in the
    # same worker left behind (CI once saw two such warnings from elsewhere)
    ours = {id(producer._producer), id(producer._dlt_producer)}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        del producer
        gc.collect()
    assert not [w for w in caught if "Unclosed AIOKafkaProducer" in str(w.message) and id(w.source) in ours]
