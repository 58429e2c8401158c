"""dispatcher: the service that turns ``batch.requested`` events into Ray jobs and terminal events.

Run it with ``llmbatch dispatcher run`` (or ``python -m dispatcher``); settings: :mod:`dispatcher.settings`.

Pure domain: :mod:`~dispatcher.states` (lifecycle), :mod:`~dispatcher.retry` (backoff),
:mod:`~dispatcher.scheduler` (launch order, backpressure), :mod:`~dispatcher.intake` (record ->
command), :mod:`~dispatcher.dlt` (dead letters), :mod:`~dispatcher.events` (result events, stable ids),
:mod:`~dispatcher.jobspec`, :mod:`~dispatcher.batch_record` (a batch's record). Transport at the edges:
:mod:`~dispatcher.store` (Redis, Lua CAS),
:mod:`~dispatcher.consumer` (Kafka in), :mod:`~dispatcher.publisher` (Kafka out),
:mod:`~dispatcher.ray_backend` (Ray Jobs API), :mod:`~dispatcher.results` (MinIO),
:mod:`~dispatcher.tracker` (leader loop; :mod:`~dispatcher.in_flight` checks each batch holding a job),
:mod:`~dispatcher.service` (wiring), :mod:`~dispatcher.http`.
"""
