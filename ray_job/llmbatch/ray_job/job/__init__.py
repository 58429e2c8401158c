"""The per-batch Ray job (see :mod:`llmbatch.ray_job`): its spec and driver, the Ray Data pipeline and
its stages, shards, resume, manifest, progress, how an attempt ends, and how the job is submitted."""
