"""A small threaded HTTP server for /metrics (one Prometheus registry) and extra JSON routes (/sd)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

JsonRoute = Callable[[], object]


class MetricsHTTPServer:
    """Serves `registry` at /metrics and each `json_routes[path]()` as JSON, on a daemon thread.

    Port 0 picks a free port; `port` tells which.
    """

    def __init__(
        self,
        host: str,
        port: int,
        registry: CollectorRegistry,
        json_routes: dict[str, JsonRoute] | None = None,
    ) -> None:
        routes = dict(json_routes or {})

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
                elif path in routes:
                    body = json.dumps(routes[path](), indent=1).encode()
                    self._send(200, "application/json", body)
                else:
                    listing = ", ".join(["/metrics", *routes])
                    self._send(404, "text/plain; charset=utf-8", f"not found; try {listing}\n".encode())

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(
                self, format: str, *args: object
            ) -> None:  # scrapes every few seconds: stay quiet
                pass

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def host(self) -> str:
        return str(self._server.server_address[0])

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    @property
    def endpoint(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
