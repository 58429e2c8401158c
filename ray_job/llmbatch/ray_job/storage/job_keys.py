"""Every Redis key the job side (Ray jobs, the batch runner) names itself, derived from a batch's
identity and the deployment's key prefix, never taken from a caller. Pure.

``<p>:progress:<batch key>``       hash: a batch's progress counters and heartbeat
                                   (:mod:`llmbatch.ray_job.job.progress`); the dispatcher reads it
``<p>:runner:run:<submission>``    string: a batch runner run's state (JSON), any replica answers from it
``<p>:runner:stop:<submission>``   string: a stop asked of that run; its replica polls for it
``<p>:runner:replica:<replica>``   string: a live runner replica (expires when it stops beating)

The dispatcher's own keys (:mod:`llmbatch.dispatcher.domain.keys`) build the progress key with
:func:`progress_key`, so the two sides cannot drift.
"""

from __future__ import annotations

DEFAULT_TENANT = "default"


def batch_key(tenant: str, batch_id: str) -> str:
    """How the state names ``tenant``'s batch: ``<batch_id>`` for the default tenant, else
    ``<tenant>/<batch_id>``."""
    return batch_id if tenant == DEFAULT_TENANT else f"{tenant}/{batch_id}"


def progress_key(prefix: str, tenant: str, batch_id: str) -> str:
    """The progress hash of ``tenant``'s batch ``batch_id``."""
    return f"{prefix}:progress:{batch_key(tenant, batch_id)}"


def run_key(prefix: str, submission_id: str) -> str:
    return f"{prefix}:runner:run:{submission_id}"


def stop_key(prefix: str, submission_id: str) -> str:
    return f"{prefix}:runner:stop:{submission_id}"


def replica_key(prefix: str, replica: str) -> str:
    return f"{prefix}:runner:replica:{replica}"


def runner_prefix(prefix: str) -> str:
    """What every runner key starts with (the job role's ACL pattern)."""
    return f"{prefix}:runner:"
