"""A tiny HTTP endpoint for probes and scraping: ``/livez``, ``/readyz``, ``/metrics``.

Plain asyncio (no web framework): GET only, one response per connection.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from dispatcher.metrics import Metrics

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[tuple[bool, dict[str, str]]]]


class HealthServer:
    def __init__(
        self,
        metrics: Metrics,
        *,
        live: Callable[[], bool],
        ready: Check,
        host: str = "0.0.0.0",  # noqa: S104 - probes come from outside the pod
        port: int = 9464,
    ) -> None:
        self.metrics = metrics
        self.live = live
        self.ready = ready
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None

    @property
    def bound_port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self.port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port)
        log.info("health endpoint listening", extra={"port": self.bound_port})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 5)
            while True:  # drain headers
                header = await asyncio.wait_for(reader.readline(), 5)
                if header in (b"\r\n", b"\n", b""):
                    break
            parts = line.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
            status, ctype, body = await self._route(method, path)
            head = (
                f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
                "Connection: close\r\n\r\n"
            ).encode()
            writer.write(head + (body if method != "HEAD" else b""))
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("health endpoint error")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in {"GET", "HEAD"}:
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/livez":
            ok = self.live()
            body = b"ok\n" if ok else b"stalled\n"
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", body
        if path == "/readyz":
            try:
                ok, detail = await asyncio.wait_for(self.ready(), 5)
            except Exception as exc:
                ok, detail = False, {"error": type(exc).__name__}
            text = "".join(f"{k}: {v}\n" for k, v in sorted(detail.items()))
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", text.encode() or b"ok\n"
        if path == "/metrics":
            return "200 OK", self.metrics.content_type, self.metrics.render()
        return "404 Not Found", "text/plain", b"try /livez /readyz /metrics\n"
