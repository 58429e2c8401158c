"""ray_job: the Ray Job that runs one attempt of one batch (Ray Data + vLLM, S3 in and out).

Invocation (what the dispatcher submits through the Ray Jobs API; see :mod:`llmbatch.ray_job.job.submit`)::

    python -m llmbatch.ray_job --spec-b64 <urlsafe base64 of zlib(JobSpec JSON)>
    python -m llmbatch.ray_job --spec-json '<JobSpec JSON>' | --spec-file spec.json | --spec-uri s3://b/k

with ``runtime_env = {"py_modules": [<ray_job dir>, <schemas dir>], "env_vars": {...}}`` and
``entrypoint_num_cpus=0``. Environment (job ``runtime_env.env_vars``, or the pods' env):

- ``LLMBATCH_S3__ENDPOINT`` (S3/MinIO URL), ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``
  (optionally ``AWS_SESSION_TOKEN``, ``AWS_REGION``);
- ``LLMBATCH_REDIS__PASSWORD`` when the Redis URL in the spec carries none;
- the engine variables of :func:`llmbatch.ray_job.engines.engine_env.engine_env` (offline mode, caches, CPU
  tuning).

What it does: reads ``input_uri`` (or the inline requests) line by line, turns every bad line into
an error line (OpenAI-style ``error.code``), renders prompts with the model's chat template, runs
vLLM (continuous batching across Ray Data batches), and writes OpenAI batch output lines into
per-attempt shards ``<output_prefix>output-a<N>-<i>.jsonl`` / ``error-a<N>-<i>.jsonl`` and, last,
``<output_prefix>manifest.json`` (:class:`llmbatch.schemas.job.Manifest`: final shards of all attempts,
counts, usage, attempt history, timings). Attempt N skips every request earlier attempts' shards
already answer, so each request appears exactly once across the manifest's shards. Progress and a
heartbeat go to the Redis hash ``progress_key`` when the spec names one.

Last stdout line: ``LLMBATCH_RESULT {json}`` with ``batch_id``, ``attempt``, ``status``
(``completed`` | ``partial`` | ``failed``), ``exit_code``, ``request_counts``, ``usage``,
``manifest_uri``, shard counts, ``timings`` and ``error`` (``{code, message}`` or null).

Exit codes (the Ray job's ``driver_exit_code``):

- ``0`` every request ended (some may be error lines); manifest ``completed``.
- ``1`` anything else, retriable: crash, engine died, S3/Ray failure, or stopped early by SIGTERM
  (``stop_job``) or the spec's deadline (manifest ``partial``, finished shards kept).
- ``2`` invalid job spec: do not retry.
- ``3`` input object not found or not readable: do not retry.

Imports only ``schemas``, the standard library, pyarrow, orjson, pydantic, ray and (lazily) vllm,
transformers and redis: it ships to Ray workers as ``py_modules``.
"""
