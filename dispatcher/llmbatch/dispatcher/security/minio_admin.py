"""Apply a tenant's pool policy (:mod:`llmbatch.dispatcher.security.minio_policy`) to MinIO, as its admin.

Through MinIO's admin API (minio-py's ``MinioAdmin``, what ``mc admin`` calls): the policy
``llmbatch-tenant-<tenant>`` is created or replaced, the pool's user is created when a secret key is
given (its secret reset when it exists), and the policy becomes the user's only one
(``SetUserOrGroupPolicy`` replaces whatever the user had). Idempotent. The secret key is read from
the environment by the caller and never printed or logged here.

Library errors are translated at this edge: an unreachable server is :class:`StorageUnavailable`
(retriable), a refusal (not an admin, a bad user name or secret) a :class:`PermanentError` naming
what to fix.
"""

from __future__ import annotations

import json
import ssl
from typing import Any

from pydantic import BaseModel

from llmbatch.dispatcher.errors import DispatcherError, PermanentError, StorageUnavailable
from llmbatch.dispatcher.security.minio_policy import policy_name, tenant_policy
from llmbatch.settings import S3Settings

SECRET_ENV = "LLMBATCH_TENANT_S3_SECRET_KEY"  # noqa: S105 (a variable name)
MIN_SECRET_CHARS = 8  # MinIO's own minimum


def pool_user(tenant: str) -> str:
    """The default access key of ``tenant``'s pool user (the policy's name)."""
    return policy_name(tenant)


class TenantApplyReport(BaseModel):
    """What :func:`apply_tenant_policy` did."""

    tenant: str
    policy: str
    user: str
    user_created: bool
    policies_of_user: list[str]


def _admin(s3: S3Settings) -> Any:
    import urllib3
    from minio.credentials.providers import StaticProvider
    from minio.minioadmin import MinioAdmin

    # bounded: an operator's command, not a service (a server that does not answer is said in seconds)
    options: dict[str, Any] = {
        "timeout": urllib3.Timeout(connect=5, read=30),
        "retries": urllib3.Retry(total=1, backoff_factor=0.2),
    }
    if s3.secure:
        cafile = str(s3.ca_file) if s3.ca_file is not None else None
        options["ssl_context"] = ssl.create_default_context(cafile=cafile)
    http_client = urllib3.PoolManager(**options)
    return MinioAdmin(
        endpoint=s3.host,
        credentials=StaticProvider(s3.access_key.get_secret_value(), s3.secret_key.get_secret_value()),
        region=s3.region,
        secure=s3.secure,
        http_client=http_client,
    )


def _translate(what: str, exc: BaseException) -> DispatcherError:
    from minio.error import MinioAdminException

    if isinstance(exc, MinioAdminException):
        code = int(getattr(exc, "_code", 0) or 0)
        body = str(getattr(exc, "_body", ""))[:300]
        if code >= 500:
            return StorageUnavailable(f"MinIO could not {what} ({code}): {body}")
        if code in (401, 403):
            return PermanentError(
                f"MinIO refused to {what} ({code}): the keys in LLMBATCH_S3__ACCESS_KEY / "
                f"LLMBATCH_S3__SECRET_KEY must be an admin's (e.g. the root user): {body}"
            )
        return PermanentError(f"MinIO refused to {what} ({code}): {body}")
    if isinstance(exc, OSError | TimeoutError) or type(exc).__module__.startswith("urllib3"):
        return StorageUnavailable(f"MinIO did not answer to {what}: {type(exc).__name__}: {str(exc)[:300]}")
    return PermanentError(f"could not {what}: {type(exc).__name__}: {str(exc)[:300]}")


def _user_exists(admin: Any, user: str) -> bool:
    from minio.error import MinioAdminException

    try:
        admin.user_info(user)
        return True
    except MinioAdminException as exc:
        if "NoSuchUser" in str(getattr(exc, "_body", "")) or int(getattr(exc, "_code", 0) or 0) == 404:
            return False
        raise


def apply_tenant_policy(
    s3: S3Settings, tenant: str, *, user: str | None = None, secret_key: str | None = None
) -> TenantApplyReport:
    """Create or replace ``tenant``'s policy and make it ``user``'s only policy (see the module)."""
    user = user or pool_user(tenant)
    if secret_key is not None and len(secret_key) < MIN_SECRET_CHARS:
        raise PermanentError(f"{SECRET_ENV} must be at least {MIN_SECRET_CHARS} characters")
    name = policy_name(tenant)
    document = tenant_policy(tenant, input_buckets=s3.readable_buckets(), results_bucket=s3.results_bucket)
    admin = _admin(s3)
    step = f"create the policy {name}"
    try:
        admin.policy_add(name, policy=document)
        step = f"look up the user {user}"
        exists = _user_exists(admin, user)
        if not exists and secret_key is None:
            raise PermanentError(
                f"the user {user!r} does not exist on MinIO: set {SECRET_ENV} (its secret key) to create it"
            )
        if secret_key is not None:
            step = f"create the user {user}"
            admin.user_add(user, secret_key)
        step = f"set the policy {name} as the only one of {user}"
        admin.policy_set(name, user=user)
        step = f"read back the user {user}"
        info = json.loads(admin.user_info(user) or "{}")
    except DispatcherError:
        raise
    except Exception as exc:
        raise _translate(step, exc) from exc
    policies = [p for p in str(info.get("policyName") or "").split(",") if p]
    return TenantApplyReport(
        tenant=tenant, policy=name, user=user, user_created=not exists, policies_of_user=policies
    )
