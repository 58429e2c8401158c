"""S3 policies (pure): a tenant's worker pool (:func:`tenant_policy`) and one batch's session on the
shared batch runner (:func:`batch_policy`).

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

from llmbatch.schemas.common import check_tenant

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
        statements.insert(
            1,
            {
                "Sid": "InputsUnderTheTenantPrefix",
                "Effect": "Allow",
                "Action": list(READ_ACTIONS),
                "Resource": [f"arn:aws:s3:::{b}/{tenant}/*" for b in inputs],
            },
        )
    return {"Version": "2012-10-17", "Statement": statements}


def batch_policy(*, input_uri: str | None, output_prefix: str) -> dict[str, Any]:
    """The session policy of one batch's temporary keys (see
    :mod:`llmbatch.dispatcher.backends.s3_sessions`): read its
    input object (``input_uri``, if any), read, write and delete under its ``output_prefix``
    (``s3://<results bucket>/<tenant>/<batch_id>/<lifecycle>/``), and list only there."""
    bucket, _, prefix = _split(output_prefix, "output_prefix")
    if not prefix.endswith("/") or "*" in prefix or "?" in prefix:
        raise ValueError(f"output_prefix {output_prefix[:200]!r} must end with '/' and hold no wildcard")
    statements: list[dict[str, Any]] = [
        {
            "Sid": "TheBatchsResults",
            "Effect": "Allow",
            "Action": list(WRITE_ACTIONS),
            "Resource": [f"arn:aws:s3:::{bucket}/{prefix}*"],
        },
        {
            "Sid": "ListOnlyTheBatchsResults",
            "Effect": "Allow",
            "Action": ["s3:ListBucket"],
            "Resource": [f"arn:aws:s3:::{bucket}"],
            "Condition": {"StringLike": {"s3:prefix": [f"{prefix}*"]}},
        },
    ]
    if input_uri is not None:
        in_bucket, _, key = _split(input_uri, "input_uri")
        if not key or key.endswith("/") or "*" in key or "?" in key:
            raise ValueError(f"input_uri {input_uri[:200]!r} must name one object, without wildcards")
        statements.insert(
            1,
            {
                "Sid": "TheBatchsInput",
                "Effect": "Allow",
                "Action": list(READ_ACTIONS),
                "Resource": [f"arn:aws:s3:::{in_bucket}/{key}"],
            },
        )
    return {"Version": "2012-10-17", "Statement": statements}


def _split(uri: str, field: str) -> tuple[str, str, str]:
    if not uri.startswith("s3://"):
        raise ValueError(f"{field} {uri[:200]!r} is not an s3:// URI")
    bucket, sep, key = uri[5:].partition("/")
    return _check_bucket(bucket), sep, key
