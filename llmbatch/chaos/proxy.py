"""A TCP proxy in front of one of the stack's services, which a fault can cut without touching the service
or the machine's network (no root, no iptables): the chaos run points its clients at the proxy.

- :meth:`FaultProxy.partition`: a network partition. No byte passes either way and new connections are
  taken and left hanging: clients meet timeouts, not refusals; what was sent arrives once it heals.
- :meth:`FaultProxy.reset`: the server failing mid-transfer. Every open connection is reset (a request in
  the middle of a write loses its connection) and new ones are reset as they come.
- :meth:`FaultProxy.heal`: back to passing bytes through.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, Literal
from urllib.parse import urlsplit

from llmbatch.dispatcher.settings import DispatcherSettings

log = logging.getLogger(__name__)

Mode = Literal["pass", "partition", "reset"]
CHUNK = 64 << 10


class FaultProxy:
    """Forwards ``127.0.0.1:<port>`` to ``target_host:target_port`` (see the module docstring)."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.mode: Mode = "pass"
        self.port = 0
        self._server: asyncio.Server | None = None
        self._open: set[asyncio.StreamWriter] = set()
        self._healed = asyncio.Event()
        self._healed.set()

    async def start(self) -> int:
        """Listen on a free loopback port; returns it."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for writer in list(self._open):
            _abort(writer)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await self._server.wait_closed()

    def partition(self) -> None:
        self.mode = "partition"
        self._healed.clear()

    def reset(self) -> None:
        """Reset every open connection now, and each new one while the mode lasts."""
        self.mode = "reset"
        self._healed.clear()
        for writer in list(self._open):
            _abort(writer)

    def heal(self) -> None:
        self.mode = "pass"
        self._healed.set()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        self._open.add(client_w)
        upstream_w: asyncio.StreamWriter | None = None
        try:
            if self.mode == "reset":
                _abort(client_w)
                return
            if self.mode == "partition":  # taken, never answered: the client waits for its timeout
                await self._healed.wait()
            upstream_r, upstream_w = await asyncio.open_connection(*self.target)
            self._open.add(upstream_w)
            await asyncio.gather(self._pump(client_r, upstream_w), self._pump(upstream_r, client_w))
        except (OSError, asyncio.IncompleteReadError) as exc:
            log.debug("proxy connection to %s ended: %s", self.target, exc)
        finally:
            for writer in (client_w, upstream_w):
                if writer is not None:
                    self._open.discard(writer)
                    _abort(writer)

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            # a partition holds every byte back: nothing arrives, and what was sent arrives after it
            # heals, as TCP's retransmissions deliver it (unless the peer gave up meanwhile)
            await self._healed.wait()
            data = await reader.read(CHUNK)
            if not data:
                break
            await self._healed.wait()
            writer.write(data)
            await writer.drain()
        with contextlib.suppress(OSError):
            writer.write_eof()


def _abort(writer: asyncio.StreamWriter) -> None:
    """Close with a reset (no FIN): what a peer sees of a server that died."""
    transport = writer.transport
    if transport is not None and not transport.is_closing():
        transport.abort()


async def behind_proxies(
    settings: DispatcherSettings, proxies: dict[str, FaultProxy], services: set[str]
) -> DispatcherSettings:
    """``settings`` whose clients reach ``services`` through a :class:`FaultProxy` each, started here and
    kept in ``proxies``: the dispatchers' Redis (the Ray side keeps a direct path), everyone's MinIO."""
    update: dict[str, Any] = {}
    for service in sorted(services):
        url = urlsplit(settings.redis.url if service == "redis" else settings.s3.endpoint)
        proxy = proxies[service] = FaultProxy(url.hostname or "127.0.0.1", int(url.port or 0))
        port = await proxy.start()
        moved = url._replace(netloc=f"{url.netloc.rsplit(':', 1)[0]}:{port}").geturl()
        if service == "redis":
            # only the dispatchers' path to Redis is cut: the Ray side keeps its own (a partition
            # between the dispatcher and Redis, not a Redis outage)
            update["redis"] = settings.redis.model_copy(update={"url": moved})
            direct = url._replace(netloc=url.netloc.rsplit("@", 1)[-1]).geturl()
            update["job"] = settings.job.model_copy(update={"redis_url": direct})
        else:
            update["s3"] = settings.s3.model_copy(update={"endpoint": moved})
    return settings.model_copy(update=update)
