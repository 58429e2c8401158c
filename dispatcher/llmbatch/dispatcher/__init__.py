"""dispatcher: the service that turns ``batch.requested`` events into Ray jobs and terminal events.

Run it with ``llmbatch dispatcher run`` (or ``python -m llmbatch.dispatcher``); settings:
:mod:`llmbatch.dispatcher.settings`.

Pure domain: :mod:`~llmbatch.dispatcher.states` (lifecycle), :mod:`~llmbatch.dispatcher.retry` (backoff),
:mod:`~llmbatch.dispatcher.scheduler` (launch order, backpressure), :mod:`~llmbatch.dispatcher.intake`
(record ->
command), :mod:`~llmbatch.dispatcher.dlt` (dead letters), :mod:`~llmbatch.dispatcher.events` (result events,
stable ids),
:mod:`~llmbatch.dispatcher.jobspec`, :mod:`~llmbatch.dispatcher.batch_record` (a batch's record). Transport
at the edges:
:mod:`~llmbatch.dispatcher.store` (Redis, Lua CAS),
:mod:`~llmbatch.dispatcher.consumer` (Kafka in), :mod:`~llmbatch.dispatcher.publisher` (Kafka out),
:mod:`~llmbatch.dispatcher.ray_backend` (Ray Jobs API), :mod:`~llmbatch.dispatcher.results` (MinIO),
:mod:`~llmbatch.dispatcher.tracker` (leader loop; :mod:`~llmbatch.dispatcher.in_flight` checks each batch
holding a job),
:mod:`~llmbatch.dispatcher.service` (wiring), :mod:`~llmbatch.dispatcher.http`.
"""
