"""A real local HTTP server that answers from a script and records what it was sent: it stands in for
Serve's proxy or the Ray dashboard in tests of our HTTP clients (and of the TLS front before them)."""

from __future__ import annotations

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, NamedTuple


class Seen(NamedTuple):
    """One request the server got."""

    method: str
    path: str
    body: bytes
    headers: dict[str, str]


class ScriptedHttpServer:
    """Answers ``answers[(method, path)]`` (status, body), else ``default``, after
    ``delays[(method, path)]`` seconds (none if absent); HTTP/1.1 on 127.0.0.1."""

    def __init__(self, default: tuple[int, bytes] = (404, b"not found")) -> None:
        self.answers: dict[tuple[str, str], tuple[int, bytes]] = {}
        self.delays: dict[tuple[str, str], float] = {}
        self.seen: list[Seen] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                owner.seen.append(Seen(self.command, self.path, self.rfile.read(length), dict(self.headers)))
                time.sleep(owner.delays.get((self.command, self.path), 0.0))
                code, body = owner.answers.get((self.command, self.path), default)
                self.send_response(code)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = _answer

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = int(self.httpd.server_address[1])
        self.address = f"http://127.0.0.1:{self.port}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
