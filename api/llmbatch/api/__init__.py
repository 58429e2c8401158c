"""llmbatch's OpenAI-compatible HTTP front door (``llmbatch api``, or ``python -m llmbatch.api``).

Part of the producer side: it turns OpenAI Files and Batches calls into the same
``batch.requested`` / ``cancel_requested`` events the producer SDK publishes, keeps uploaded files in
MinIO/S3, and reads batch state from the dispatcher's Redis the way ``llmbatch jobs get`` does.

Subpackages, one job each, each importing only those listed before it: :mod:`llmbatch.api.store` (object
storage, the API's records and ids, the dispatcher's state), :mod:`llmbatch.api.tenancy` (API keys, rate,
quotas, usage), :mod:`llmbatch.api.batches` (the batch service, its reads, OpenAI's statuses, result shards,
expiry), :mod:`llmbatch.api.files` (uploads and result files), :mod:`llmbatch.api.webhooks` (webhook
endpoints), :mod:`llmbatch.api.retention` (the collector of what expired) and :mod:`llmbatch.api.http` (the
FastAPI app). Shared by all: :mod:`llmbatch.api.settings` (``LLMBATCH_API__*``), :mod:`llmbatch.api.errors`
(OpenAI error bodies) and :mod:`llmbatch.api.objects` (OpenAI's objects); :mod:`llmbatch.api.__main__` is the
uvicorn entrypoint.
"""
