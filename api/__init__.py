"""llmbatch's OpenAI-compatible HTTP front door (``llmbatch api``, or ``python -m api``).

Part of the producer side: it turns OpenAI Files and Batches calls into the same
``batch.requested`` / ``cancel_requested`` events the producer SDK publishes, keeps uploaded files in
MinIO/S3, and reads batch state from the dispatcher's Redis the way ``llmbatch jobs get`` does.

Modules, one job each: :mod:`api.settings` (``LLMBATCH_API__*``), :mod:`api.errors` (OpenAI error
bodies), :mod:`api.objects` (OpenAI's objects), :mod:`api.auth` (hashed API keys -> tenants, quota),
:mod:`api.upload` (line-by-line validation of uploads), :mod:`api.records` (ids, key layout, stored
records), :mod:`api.storage` (object storage port + MinIO), :mod:`api.state` (dispatcher state
port + Redis), :mod:`api.status` (state -> OpenAI Batch, pure), :mod:`api.results` (result shards as
one file), :mod:`api.files` and :mod:`api.batches` (the services), :mod:`api.app` (FastAPI),
:mod:`api.__main__` (uvicorn entrypoint).
"""
