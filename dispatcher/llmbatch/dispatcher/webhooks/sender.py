"""One webhook attempt over HTTP(S), to the address :func:`~llmbatch.dispatcher.webhooks.targets.resolve`
checked (the connection goes to that address; TLS still verifies the URL's host name, sent as SNI).

Standard library ``http.client`` on a thread pool of its own (as :mod:`llmbatch.dispatcher.backends.serve_api`
calls Serve): redirects are not followed (a 3xx is a failed attempt), the answer's body is read up to
:data:`MAX_ANSWER_BYTES` and dropped. :class:`Sender` is the seam tests plug another transport into.
"""

from __future__ import annotations

import asyncio
import http.client
import socket
import ssl
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Protocol

from llmbatch.dispatcher.webhooks.targets import IpAddress, Target

MAX_ANSWER_BYTES = 64 << 10


@dataclass(frozen=True, slots=True)
class Attempt:
    """How one attempt ended: the HTTP status, or why there was none."""

    status: int | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    def describe(self) -> str:
        return f"HTTP {self.status}" if self.status is not None else self.error


class Sender(Protocol):
    async def send(
        self, target: Target, address: IpAddress, headers: dict[str, str], body: bytes, timeout_s: float
    ) -> Attempt: ...


class _PinnedHTTP(http.client.HTTPConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float) -> None:
        super().__init__(host, port, timeout=timeout)
        self._address = address

    def connect(self) -> None:
        self.sock = socket.create_connection((self._address, self.port), self.timeout)


class _PinnedHTTPS(http.client.HTTPSConnection):
    def __init__(self, host: str, port: int, address: str, timeout: float, context: ssl.SSLContext) -> None:
        super().__init__(host, port, timeout=timeout, context=context)
        self._address = address
        self._tls = context

    def connect(self) -> None:
        raw = socket.create_connection((self._address, self.port), self.timeout)
        self.sock = self._tls.wrap_socket(raw, server_hostname=self.host)


class HttpSender:
    """:class:`Sender` over ``http.client`` (``context``: the TLS trust, the system's by default)."""

    def __init__(self, *, workers: int = 8, context: ssl.SSLContext | None = None) -> None:
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="webhook")
        self._context = context or ssl.create_default_context()

    async def send(
        self, target: Target, address: IpAddress, headers: dict[str, str], body: bytes, timeout_s: float
    ) -> Attempt:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, self._send, target, address, headers, body, timeout_s)

    def _send(
        self, target: Target, address: IpAddress, headers: dict[str, str], body: bytes, timeout_s: float
    ) -> Attempt:
        conn: http.client.HTTPConnection
        if target.scheme == "https":
            conn = _PinnedHTTPS(target.host, target.port, str(address), timeout_s, self._context)
        else:
            conn = _PinnedHTTP(target.host, target.port, str(address), timeout_s)
        try:
            conn.request("POST", target.path, body=body, headers=headers)
            answer = conn.getresponse()
            answer.read(MAX_ANSWER_BYTES)
            return Attempt(answer.status)
        except (OSError, http.client.HTTPException, ValueError) as exc:  # ssl.SSLError is an OSError
            return Attempt(None, f"{type(exc).__name__}: {exc}"[:300])
        finally:
            conn.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
