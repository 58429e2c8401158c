"""A TLS front for a server that speaks plain HTTP only: the Ray dashboard (its Jobs and Serve APIs).

Ray serves its dashboard over HTTP only. ``llmbatch stack up --tls`` starts this process before it: it
takes TLS connections on 127.0.0.1 with the run folder's certificate and relays each one's bytes to the
dashboard's plaintext loopback port. On Kubernetes it is a sidecar of the Ray head pod that listens on
the pod's address (``deploy/kubernetes/components/ray-https``).

It holds at most :data:`MAX_CONNECTIONS` connections (more are closed at once), gives a handshake
:data:`HANDSHAKE_S` and drops a connection idle for :data:`IDLE_S` either way.

``python -m llmbatch.stack.tls_front --help`` shows the arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import ssl
import sys
from collections.abc import Sequence

MAX_CONNECTIONS = 256
HANDSHAKE_S = 10.0
IDLE_S = 600.0
CHUNK = 64 << 10


async def _pump(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until the reader's end: pass on a clean EOF, drop the other side on a reset or idle."""
    try:
        while data := await asyncio.wait_for(reader.read(CHUNK), IDLE_S):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (OSError, TimeoutError, ssl.SSLError):
        writer.transport.abort()  # the other pump's reader sees its end at once


async def _close(writer: asyncio.StreamWriter) -> None:
    writer.close()
    with contextlib.suppress(OSError, ssl.SSLError, TimeoutError):
        await asyncio.wait_for(writer.wait_closed(), 5)


class TlsFront:
    """Relays TLS connections (see :meth:`serve`) to ``target_port`` on 127.0.0.1."""

    def __init__(self, target_port: int, context: ssl.SSLContext) -> None:
        self.target_port = target_port
        self.context = context
        self.open = 0

    async def handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        if self.open >= MAX_CONNECTIONS:
            await _close(client_w)
            return
        self.open += 1
        try:
            try:
                target_r, target_w = await asyncio.wait_for(
                    asyncio.open_connection("127.0.0.1", self.target_port), HANDSHAKE_S
                )
            except (OSError, TimeoutError):
                return  # the dashboard is down: the client sees the connection close
            up = asyncio.create_task(_pump(client_r, target_w))
            try:
                # the dashboard's side decides: when it closes (after a client's EOF, too), so do we
                await _pump(target_r, client_w)
            finally:
                up.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await up
                await _close(target_w)
        finally:
            self.open -= 1
            await _close(client_w)

    async def serve(
        self, listen_port: int, ready: asyncio.Event | None = None, *, listen_host: str = "127.0.0.1"
    ) -> None:
        server = await asyncio.start_server(
            self.handle, listen_host, listen_port, ssl=self.context, ssl_handshake_timeout=HANDSHAKE_S
        )
        async with server:
            if ready is not None:
                ready.set()
            await server.serve_forever()


def server_context(cert: str, key: str) -> ssl.SSLContext:
    """A TLS 1.2+ server context presenting ``cert`` (with ``key``)."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m llmbatch.stack.tls_front",
        description="Accept TLS on LISTEN_HOST:LISTEN_PORT and relay every connection to "
        "127.0.0.1:TARGET_PORT (the TLS front of the Ray dashboard: a process of the local "
        "stack, a sidecar of a Ray head pod).",
    )
    parser.add_argument(
        "--listen-host",
        default="127.0.0.1",
        help="address to listen on (default 127.0.0.1; 0.0.0.0 in a pod)",
    )
    parser.add_argument("--listen-port", type=int, required=True, help="port to take TLS connections on")
    parser.add_argument("--target-port", type=int, required=True, help="plaintext port to relay to")
    parser.add_argument("--cert", required=True, help="PEM certificate (chain) to present")
    parser.add_argument("--key", required=True, help="PEM private key of --cert")
    args = parser.parse_args(argv)
    for name in ("listen_port", "target_port"):
        if not 0 < getattr(args, name) < 65536:
            parser.error(f"--{name.replace('_', '-')} must be a port number (1-65535)")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        context = server_context(args.cert, args.key)
    except (OSError, ssl.SSLError) as exc:
        print(f"tls_front: cannot load --cert/--key: {exc}", file=sys.stderr)
        return 2

    async def run() -> None:
        loop = asyncio.get_running_loop()
        task = asyncio.current_task()
        assert task is not None
        loop.add_signal_handler(signal.SIGTERM, task.cancel)
        with contextlib.suppress(asyncio.CancelledError):
            await TlsFront(args.target_port, context).serve(args.listen_port, listen_host=args.listen_host)

    asyncio.run(run())
    return 0


if __name__ == "__main__":
    sys.exit(main())
