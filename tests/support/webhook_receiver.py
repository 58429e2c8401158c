"""A webhook receiver as a tenant would write one, with the official ``openai`` SDK (every delivery
checked with ``client.webhooks.unwrap``: signature, timestamp tolerance, event shape) or with the
``standardwebhooks`` library (``Webhook(secret).verify``). It can go down (its port closed: connections
refused) and come back on the same port."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Literal

from openai import OpenAI
from standardwebhooks.webhooks import Webhook

from llmbatch.stack.ports import free_port


@dataclass
class Received:
    webhook_id: str
    type: str
    batch_id: str
    event_id: str


@dataclass
class Receiver:
    """Verifies with ``secret`` (set it once the endpoint is made); ``accepted``: what verified, in order."""

    secret: str = ""
    library: Literal["openai", "standardwebhooks"] = "openai"
    port: int = field(default_factory=free_port)
    accepted: list[Received] = field(default_factory=list)
    refused: list[str] = field(default_factory=list)
    _server: ThreadingHTTPServer | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hooks/llmbatch"

    def up(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0)).decode()
                status = 200
                try:
                    got = receiver.verify(body, dict(self.headers.items()))
                    with receiver._lock:
                        receiver.accepted.append(got)
                except Exception as exc:
                    status = 400
                    with receiver._lock:
                        receiver.refused.append(f"{type(exc).__name__}: {exc}")
                self.send_response(status)
                self.send_header("content-length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def verify(self, body: str, headers: dict[str, str]) -> Received:
        """What the delivery says, once its library verified it (raises if it does not)."""
        if self.library == "openai":
            event: Any = OpenAI(
                api_key="unused", base_url="http://127.0.0.1:9", webhook_secret=self.secret
            ).webhooks.unwrap(body, headers)
            return Received(headers["webhook-id"], event.type, event.data.id, event.id)
        payload = Webhook(self.secret).verify(body, headers)
        return Received(headers["webhook-id"], payload["type"], payload["data"]["id"], payload["id"])

    def down(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def ids(self) -> list[str]:
        with self._lock:
            return [r.webhook_id for r in self.accepted]
