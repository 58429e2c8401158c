"""Operator tools: ``llmbatch jobs list|get|cancel`` and ``llmbatch dlq list|inspect|replay``.

- :mod:`llmbatch.dispatcher.ops.common` - settings, one-line errors, exit codes, time parsing, JSON output.
- :mod:`llmbatch.dispatcher.ops.jobs` - read models of batches in Redis (pure view building + queries).
- :mod:`llmbatch.dispatcher.ops.jobs_cli` - the ``jobs`` command group.
- :mod:`llmbatch.dispatcher.ops.dlq_reader` - read the dead-letter topic as :class:`DeadLetterView` records.
- :mod:`llmbatch.dispatcher.ops.replay` - replay planning and records (pure), the rate limiter.
- :mod:`llmbatch.dispatcher.ops.replay_publish` - the publishing edge (Kafka) and the replay ledger (Redis).
- :mod:`llmbatch.dispatcher.ops.dlq_cli` - the ``dlq`` command group.
"""
