"""The dispatcher: the service that turns ``batch.requested`` events into runs and terminal events.

Run it with ``llmbatch dispatcher run`` (or ``python -m llmbatch.dispatcher``); settings:
:mod:`llmbatch.dispatcher.settings`. Its parts, each a subpackage with one job, lower ones first
(an import-linter contract keeps them free of cycles):

- :mod:`~llmbatch.dispatcher.domain`: pure: states, key names, the batch record, dead letters,
  events with stable ids, scheduling scores, retry policy;
- :mod:`~llmbatch.dispatcher.state`: the batches' state in Redis (Lua compare-and-set);
- :mod:`~llmbatch.dispatcher.kafka`: publishing events and dead letters, reading records back;
- :mod:`~llmbatch.dispatcher.intake`: the requests-topic consumer and what it does with a record;
- :mod:`~llmbatch.dispatcher.backends`: where batches run (Ray Jobs, the batch runner, Serve);
- :mod:`~llmbatch.dispatcher.runs`: the leader's work: launch, track, finish, clean up;
- :mod:`~llmbatch.dispatcher.security`: Kafka ACLs, Redis ACL users, MinIO policies per role;
- :mod:`~llmbatch.dispatcher.ops`: the operator CLI (jobs, dlq, engines).

Beside them: :mod:`~llmbatch.dispatcher.errors` (one hierarchy, ``retriable``), settings, metrics,
logs, :mod:`~llmbatch.dispatcher.http` (/livez /readyz /metrics; their answers:
:mod:`~llmbatch.dispatcher.probes`), :mod:`~llmbatch.dispatcher.start_checks` (what is checked once at
start) and :mod:`~llmbatch.dispatcher.service` (the wiring).
"""
