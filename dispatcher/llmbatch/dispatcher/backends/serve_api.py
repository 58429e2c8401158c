"""Ray Serve's REST API on the Ray dashboard (the same address as the Jobs API).

``PUT /api/serve/applications/`` deploys a declarative config (every application of the cluster:
those it does not list are removed), ``GET`` reports applications, deployments and replicas.
Transport only: connection trouble becomes :class:`~llmbatch.dispatcher.errors.RayUnavailable` (retriable),
a refused config :class:`~llmbatch.dispatcher.errors.PermanentError`.
"""

from __future__ import annotations

import asyncio
import http.client
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import orjson
from pydantic import SecretStr

from llmbatch.dispatcher.backends.ray_http import auth_headers, tls_context
from llmbatch.dispatcher.errors import PermanentError, RayUnavailable
from llmbatch.settings import RaySettings

PATH = "/api/serve/applications/"
# A first deploy starts Serve's controller and proxies before it answers: 14 s on an idle 2-core
# head, more beside other work. A client that gives up sooner only makes the next poll start over.
DEPLOY_TIMEOUT_S = 180.0


class ServeApi:
    """Deploy and read the cluster's Serve applications through the dashboard."""

    def __init__(
        self,
        address: str,
        timeout_s: float = 30.0,
        *,
        token: SecretStr | None = None,
        ca_file: Path | None = None,
        deploy_timeout_s: float = DEPLOY_TIMEOUT_S,
    ) -> None:
        self.address = address.rstrip("/")
        self.timeout_s = timeout_s  # for reads
        self.deploy_timeout_s = max(deploy_timeout_s, timeout_s)
        self.headers = {"Content-Type": "application/json", **auth_headers(token)}
        self.context = tls_context(self.address, ca_file)

    @classmethod
    def of(cls, ray: RaySettings, timeout_s: float = 30.0) -> ServeApi:
        """The API of the cluster ``ray`` names (its address, token and CA bundle)."""
        return cls(ray.address, timeout_s, token=ray.auth_token, ca_file=ray.ca_file)

    def _request(
        self, method: str, body: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Any:
        data = orjson.dumps(body) if body is not None else None
        req = urllib.request.Request(  # noqa: S310 - the dashboard address from settings
            self.address + PATH, data=data, method=method, headers=self.headers
        )
        try:
            timeout = timeout_s or self.timeout_s
            with urllib.request.urlopen(req, timeout=timeout, context=self.context) as resp:  # noqa: S310
                raw = resp.read()
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:2000].decode("utf-8", "replace")
            if exc.code in (401, 403):  # a missing or rotated token: an outage of every batch, as for jobs
                raise RayUnavailable(
                    f"the Ray dashboard at {self.address} refused our credentials "
                    f"({exc.code}): check LLMBATCH_RAY__AUTH_TOKEN"
                ) from exc
            if exc.code >= 500 or exc.code == 429:
                raise RayUnavailable(f"Ray Serve API answered {exc.code}: {detail}") from exc
            raise PermanentError(f"Ray Serve refused the config ({exc.code}): {detail}") from exc
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            raise RayUnavailable(f"Ray dashboard at {self.address} did not answer: {exc}") from exc
        try:
            return orjson.loads(raw) if raw.strip() else None
        except orjson.JSONDecodeError as exc:  # a proxy's error page, a dashboard still starting
            raise RayUnavailable(
                f"Ray Serve API at {self.address} answered something that is not JSON: {raw[:200]!r}"
            ) from exc

    async def deploy(self, config: dict[str, Any]) -> None:
        """Apply ``config`` (a Serve multi-application config) to the cluster."""
        await asyncio.to_thread(self._request, "PUT", config, self.deploy_timeout_s)

    async def status(self) -> dict[str, Any]:
        """The cluster's Serve details (``applications -> deployments -> replicas``)."""
        details = await asyncio.to_thread(self._request, "GET")
        return details if isinstance(details, dict) else {}
