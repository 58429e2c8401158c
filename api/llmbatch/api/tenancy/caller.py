"""Who calls: the tenant of a request's API key, after one request of its rate (a route dependency)."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request


def _tenant(request: Request) -> str:
    """The caller's tenant (from its API key), after taking one request of its quota."""
    services = request.app.state.services
    name: str = services.auth.tenant_of(request.headers.get("authorization"))
    services.limiter.check(name)
    return name


Tenant = Annotated[str, Depends(_tenant)]
"""A route parameter: the calling tenant's name."""
