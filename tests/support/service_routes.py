"""Cluster DNS, Service routing and the pod network for a process on this machine that talks to
Kubernetes Services by name or to pods by IP (the KubeRay operator calls a Ray head's dashboard at
``<cluster>-head-svc.<namespace>.svc.cluster.local:8265`` and Serve's proxy at ``<pod IP>:8000``;
the tests give pods made-up 10.244.0.x addresses).

No cluster DNS and no kube-proxy run here. Started with ``HTTP_PROXY`` pointing at a
:class:`ServiceRoutes`, a Go program (or any client honouring the variable) sends its plain-HTTP
requests here; each is forwarded to the local address the test routed that host and port to, and a
host with no route gets 502 naming it. Loopback addresses (the API server) are never proxied by
such clients. Binds 127.0.0.1 on a free port; :meth:`stop` closes it.
"""

from __future__ import annotations

import http.client
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlsplit

# headers that belong to one hop (RFC 9110 section 7.6.1), not forwarded
HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection",
              "te", "trailer", "transfer-encoding", "upgrade"}


class ServiceRoutes:
    """A plain-HTTP forward proxy whose only upstreams are the routes the test adds."""

    def __init__(self) -> None:
        self.routes: dict[tuple[str, int], tuple[str, int]] = {}
        self.seen: list[tuple[str, str, int]] = []  # (method, URL, status) of each request
        self._lock = threading.Lock()
        routes = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                return  # the test reads `seen`

            def _forward(self) -> None:
                routes.forward(self)

            do_GET = do_PUT = do_POST = do_DELETE = do_PATCH = do_HEAD = _forward

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def start(self) -> ServiceRoutes:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=10)

    def route(self, host: str, port: int, to_port: int, to_host: str = "127.0.0.1") -> None:
        """Send requests for ``host:port`` to ``to_host:to_port``."""
        with self._lock:
            self.routes[(host, port)] = (to_host, to_port)

    def forward(self, request: BaseHTTPRequestHandler) -> None:
        target = urlsplit(request.path)
        key = (target.hostname or "", target.port or 80)
        with self._lock:
            upstream = self.routes.get(key)
        length = int(request.headers.get("Content-Length") or 0)
        body = request.rfile.read(length) if length else None
        if upstream is None:
            self._answer(request, 502, f"no route to {key[0]}:{key[1]}".encode(), {})
            return
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_BY_HOP}
        conn = http.client.HTTPConnection(*upstream, timeout=30)
        try:
            path = target.path + (f"?{target.query}" if target.query else "")
            conn.request(request.command, path or "/", body=body, headers=headers)
            resp = conn.getresponse()
            data = resp.read()
            self._answer(request, resp.status, data,
                         {k: v for k, v in resp.getheaders() if k.lower() not in HOP_BY_HOP})
        except OSError as exc:
            self._answer(request, 502, f"{key[0]}:{key[1]} -> {upstream}: {exc}".encode(), {})
        finally:
            conn.close()

    def _answer(self, request: BaseHTTPRequestHandler, status: int, data: bytes,
                headers: dict[str, str]) -> None:
        with self._lock:
            self.seen.append((request.command, request.path, status))
        request.send_response(status)
        for name, value in headers.items():
            if name.lower() != "content-length":
                request.send_header(name, value)
        request.send_header("Content-Length", str(len(data)))
        request.end_headers()
        if request.command != "HEAD":
            request.wfile.write(data)
