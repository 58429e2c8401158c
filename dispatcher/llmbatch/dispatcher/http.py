"""A tiny HTTP endpoint for probes and scraping: ``/livez``, ``/readyz``, ``/metrics``.

Plain asyncio (no web framework): GET only, one response per connection. It holds under abuse: the
whole request head must arrive within ``HEAD_TIMEOUT_S`` (a client sending one header line every few
seconds is cut off), with at most ``MAX_HEADERS`` lines of at most ``MAX_LINE_BYTES`` each (431
otherwise); at most ``MAX_CONNECTIONS`` are served at once (more are closed at once); and ``/readyz``
answers from a result at most ``READY_CACHE_S`` old, so probes cannot turn into a stream of Redis
PINGs and Kafka metadata fetches.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from llmbatch.dispatcher.metrics import Metrics
from llmbatch.schemas.errors import LLMBatchError

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[tuple[bool, dict[str, str]]]]

HEAD_TIMEOUT_S = 5.0
MAX_HEADERS = 64
MAX_LINE_BYTES = 8192
MAX_CONNECTIONS = 32
READY_CACHE_S = 2.0


class HeadTooLarge(LLMBatchError):
    """The request head has too many or too long lines."""


class HealthServer:
    def __init__(
        self,
        metrics: Metrics,
        *,
        live: Callable[[], bool],
        ready: Check,
        host: str = "0.0.0.0",  # noqa: S104 - probes come from outside the pod
        port: int = 9464,
        ready_cache_s: float = READY_CACHE_S,
    ) -> None:
        self.metrics = metrics
        self.live = live
        self.ready = ready
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._open = 0
        self._ready_at = -1e9
        self._ready_result: tuple[bool, dict[str, str]] = (False, {})
        self._ready_lock = asyncio.Lock()
        self.ready_cache_s = ready_cache_s

    @property
    def bound_port(self) -> int:
        if self._server is None or not self._server.sockets:
            return self.port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._handle, self.host, self.port, limit=MAX_LINE_BYTES)
        log.info("health endpoint listening", extra={"port": self.bound_port})

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 2)
            self._server = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self._open >= MAX_CONNECTIONS:
            writer.close()
            return
        self._open += 1
        try:
            try:
                line = await asyncio.wait_for(self._read_head(reader), HEAD_TIMEOUT_S)
            except HeadTooLarge:
                await self._respond(
                    writer,
                    "GET",
                    ("431 Request Header Fields Too Large", "text/plain", b"request head too large\n"),
                )
                # a short lingering read: closing with unread input would reset the connection and
                # the client could lose the answer
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(reader.read(1 << 16), 0.5)
                return
            parts = line.decode("latin-1").split()
            method, path = (parts[0], parts[1].split("?", 1)[0]) if len(parts) >= 2 else ("", "")
            await self._respond(writer, method, await self._route(method, path))
        except (TimeoutError, ConnectionError):
            pass
        except Exception:
            log.exception("health endpoint error")
        finally:
            self._open -= 1
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    @staticmethod
    async def _read_head(reader: asyncio.StreamReader) -> bytes:
        """The request line (headers are read and dropped); raises :class:`HeadTooLarge`."""
        try:
            line = await reader.readline()
            for _ in range(MAX_HEADERS):
                header = await reader.readline()
                if header in (b"\r\n", b"\n", b""):
                    return line
        except (asyncio.LimitOverrunError, ValueError):  # a line over MAX_LINE_BYTES
            raise HeadTooLarge from None
        raise HeadTooLarge

    @staticmethod
    async def _respond(writer: asyncio.StreamWriter, method: str, response: tuple[str, str, bytes]) -> None:
        status, ctype, body = response
        head = (
            f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        writer.write(head + (body if method != "HEAD" else b""))
        await writer.drain()

    async def _readiness(self) -> tuple[bool, dict[str, str]]:
        """The readiness check's result, run at most once per ``ready_cache_s`` (one at a time)."""
        async with self._ready_lock:
            now = asyncio.get_running_loop().time()
            if now - self._ready_at >= self.ready_cache_s:
                try:
                    self._ready_result = await asyncio.wait_for(self.ready(), 5)
                except Exception as exc:
                    self._ready_result = (False, {"error": type(exc).__name__})
                self._ready_at = asyncio.get_running_loop().time()
            return self._ready_result

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method not in {"GET", "HEAD"}:
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/livez":
            ok = self.live()
            body = b"ok\n" if ok else b"stalled\n"
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", body
        if path == "/readyz":
            ok, detail = await self._readiness()
            text = "".join(f"{k}: {v}\n" for k, v in sorted(detail.items()))
            return ("200 OK" if ok else "503 Service Unavailable"), "text/plain", text.encode() or b"ok\n"
        if path == "/metrics":
            return "200 OK", self.metrics.content_type, self.metrics.render()
        return "404 Not Found", "text/plain", b"try /livez /readyz /metrics\n"
