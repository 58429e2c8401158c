"""The S3 policy of one tenant's worker pool (pure): what its jobs may read and write.

A pooled tenant's jobs run on Ray nodes whose environment holds that tenant's own S3 keys
(``LLMBATCH_TENANTS__POOLS``); the keys' user gets this policy and nothing else, so a job (the
prompts and the model's code run there) can:

- read objects under ``<bucket>/<tenant>/`` of every bucket inputs may come from (the input bucket
  and ``LLMBATCH_S3__ALLOWED_INPUT_BUCKETS``), and list only there;
- read, write and delete objects under ``<results bucket>/<tenant>/`` (its shards, its manifest, the
  spec the dispatcher uploaded for it), and list only there;

and nothing else: not another tenant's prefix, not a bucket outside the settings, not the
bucket list. The document is the AWS policy language MinIO speaks (``mc admin policy create``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from schemas.common import check_tenant

POLICY_PREFIX = "llmbatch-tenant-"
READ_ACTIONS = ("s3:GetObject",)
WRITE_ACTIONS = (
    "s3:GetObject",
    "s3:PutObject",
    "s3:DeleteObject",
    "s3:AbortMultipartUpload",
    "s3:ListMultipartUploadParts",
)
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


def policy_name(tenant: str) -> str:
    """``llmbatch-tenant-<tenant>``: the policy's name on the server (one per tenant)."""
    return POLICY_PREFIX + check_tenant(tenant)


def _check_bucket(bucket: str) -> str:
    if not _BUCKET.fullmatch(bucket) or ".." in bucket:
        raise ValueError(f"bucket {bucket!r} is not a valid S3 bucket name")
    return bucket


def tenant_policy(tenant: str, *, input_buckets: Iterable[str], results_bucket: str) -> dict[str, Any]:
    """The policy document of ``tenant``'s pool user (see the module docstring)."""
    check_tenant(tenant)
    inputs = sorted({_check_bucket(b) for b in input_buckets} - {results_bucket})
    results = _check_bucket(results_bucket)
    statements: list[dict[str, Any]] = [
        {
            "Sid": "ResultsUnderTheTenantPrefix",
            "Effect": "Allow",
            "Action": list(WRITE_ACTIONS),
            "Resource": [f"arn:aws:s3:::{results}/{tenant}/*"],
        },
        {
            "Sid": "ListOnlyTheTenantPrefix",
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": [f"arn:aws:s3:::{b}" for b in [results, *inputs]],
            "Condition": {"StringLike": {"s3:prefix": [f"{tenant}/*", f"{tenant}/"]}},
        },
    ]
    if inputs:
        statements.insert(1, {
            "Sid": "InputsUnderTheTenantPrefix",
            "Effect": "Allow",
            "Action": list(READ_ACTIONS),
            "Resource": [f"arn:aws:s3:::{b}/{tenant}/*" for b in inputs],
        })
    return {"Version": "2012-10-17", "Statement": statements}
