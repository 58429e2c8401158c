"""Who calls and what a tenant may use: API keys and the request rate (:mod:`~llmbatch.api.tenancy.auth`),
the calling tenant as a route dependency (:mod:`~llmbatch.api.tenancy.caller`), the active-batch quota
(:mod:`~llmbatch.api.tenancy.quota`), the token and storage quotas of a create
(:mod:`~llmbatch.api.tenancy.tenant_limits`) and ``GET /v1/usage`` (:mod:`~llmbatch.api.tenancy.usage`)."""
