"""Operator tools: ``llmbatch jobs list|get|cancel`` and ``llmbatch dlq list|inspect|replay``.

- :mod:`dispatcher.ops.common` - settings, one-line errors, exit codes, time parsing, JSON output.
- :mod:`dispatcher.ops.jobs` - read models of batches in Redis (pure view building + queries).
- :mod:`dispatcher.ops.jobs_cli` - the ``jobs`` command group.
- :mod:`dispatcher.ops.dlq_reader` - read the dead-letter topic as :class:`DeadLetterView` records.
- :mod:`dispatcher.ops.replay` - replay planning (pure), the rate limiter, the Redis replay ledger and
  the publishing edge.
- :mod:`dispatcher.ops.dlq_cli` - the ``dlq`` command group.
"""
