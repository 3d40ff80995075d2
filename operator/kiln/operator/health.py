"""The operator pod's own HTTP endpoint, up before leader election (port ``--health-port``):

- ``/healthz``: 200 while the process can work: a standby waiting for the Lease, or a leader
  whose controller loop is alive (its heartbeat is fresh and no worker died); 503 otherwise,
  so the kubelet restarts a replica whose work loop hangs.
- ``/readyz``: 200 on every replica that serves this endpoint (a standby is a ready hot
  spare, so a two-replica install is not Degraded in Argo CD); the body says whether it leads.
- ``/metrics``: Prometheus text: reconciles, errors, queue depth, reconcile durations,
  leadership (``kiln_operator_*``).
"""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Callable


def serve_health(port: int, leading: Callable[[], bool], host: str = "0.0.0.0",
                 alive: Callable[[], bool] | None = None,
                 metrics: Callable[[], str] | None = None) -> ThreadingHTTPServer:
    """Serve ``/healthz``, ``/readyz`` and ``/metrics`` on ``port`` in a daemon thread.
    ``leading()``: this replica runs the controller; ``alive()``: its work loop is healthy
    (asked only while leading); ``metrics()``: the Prometheus text.  Returns the server
    (``shutdown()`` stops it)."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            ctype = "text/plain"
            if self.path.startswith("/healthz"):
                ok = not leading() or alive is None or alive()
                code, body = (200, b"ok\n") if ok else (503, b"work loop stalled\n")
            elif self.path.startswith("/readyz"):
                code, body = 200, b"ok: leader\n" if leading() else b"ok: standby\n"
            elif self.path.startswith("/metrics") and metrics is not None:
                code, body = 200, metrics().encode()
                ctype = "text/plain; version=0.0.4"
            else:
                code, body = 404, b"not found\n"
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args) -> None:  # quiet
            pass

    srv = ThreadingHTTPServer((host, port), Handler)
    threading.Thread(target=srv.serve_forever, name="kiln-health", daemon=True).start()
    return srv
