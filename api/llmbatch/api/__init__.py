"""llmbatch's OpenAI-compatible HTTP front door (``llmbatch api``, or ``python -m llmbatch.api``).

Part of the producer side: it turns OpenAI Files and Batches calls into the same
``batch.requested`` / ``cancel_requested`` events the producer SDK publishes, keeps uploaded files in
MinIO/S3, and reads batch state from the dispatcher's Redis the way ``llmbatch jobs get`` does.

Modules, one job each: :mod:`llmbatch.api.settings` (``LLMBATCH_API__*``), :mod:`llmbatch.api.errors` (OpenAI
error
bodies), :mod:`llmbatch.api.objects` (OpenAI's objects), :mod:`llmbatch.api.auth` (hashed API keys ->
tenants, quota),
:mod:`llmbatch.api.upload` (line-by-line validation of uploads), :mod:`llmbatch.api.records` (ids, key
layout, stored
records), :mod:`llmbatch.api.storage` (object storage port + MinIO), :mod:`llmbatch.api.state` (dispatcher
state
port + Redis), :mod:`llmbatch.api.status` (state -> OpenAI Batch, pure), :mod:`llmbatch.api.results` (result
shards as
one file), :mod:`llmbatch.api.files` and :mod:`llmbatch.api.batches` (the services), :mod:`llmbatch.api.app`
(FastAPI),
:mod:`llmbatch.api.__main__` (uvicorn entrypoint).
"""
