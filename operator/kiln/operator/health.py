"""A tiny health endpoint for the operator pod, up before leader election so that a standby
replica is alive (``/healthz`` 200) but not ready (``/readyz`` 503 until it leads and kopf
runs)."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def serve_health(port: int, ready: Callable[[], bool], host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve ``/healthz`` (always 200) and ``/readyz`` (200 when ``ready()``) on ``port`` in a
    daemon thread.  Returns the server (``shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path.startswith("/healthz"):
                code = 200
            elif self.path.startswith("/readyz"):
                code = 200 if ready() else 503
            else:
                code = 404
            body = {200: b"ok\n", 503: b"not ready\n", 404: b"not found\n"}[code]
            self.send_response(code)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet
            pass

    srv = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=srv.serve_forever, name="kiln-health", daemon=True).start()
    return srv
