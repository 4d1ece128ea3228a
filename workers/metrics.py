"""Prometheus ``/metrics`` of a Kiln process: Kiln's series plus the Temporal SDK's runtime metrics.

The Temporal SDK exports its metrics (workflow/activity task latencies, pollers, slots, …) from a
Temporal ``Runtime`` whose Prometheus endpoint binds a private loopback port; ``exposition``
serves Kiln's series (``kiln.core.telemetry.prometheus``) and that text together. A worker serves
``/metrics`` on ``KILN_METRICS_PORT`` (``MetricsServer``); the API on its own port.
"""

from __future__ import annotations

import socket
import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest


def free_loopback_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class TemporalMetrics:
    """A Temporal ``Runtime`` exporting SDK metrics on a private loopback port."""

    def __init__(self) -> None:
        from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

        self.port = free_loopback_port()
        self.runtime = Runtime(
            telemetry=TelemetryConfig(metrics=PrometheusConfig(bind_address=f"127.0.0.1:{self.port}"))
        )

    def text(self) -> bytes:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=2) as resp:
                return bytes(resp.read())
        except OSError:
            return b""


def exposition(temporal: TemporalMetrics | None) -> bytes:
    """Kiln's series, then the Temporal SDK's (when a runtime exports them)."""
    body = generate_latest()
    if temporal is not None:
        body += b"\n" + temporal.text()
    return body


class MetricsServer:
    """``/metrics`` over HTTP for a worker process, in a daemon thread; ``stop()`` closes it."""

    def __init__(self, host: str, port: int, temporal: TemporalMetrics | None) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404)
                    return
                body = exposition(outer.temporal)
                self.send_response(200)
                self.send_header("Content-Type", CONTENT_TYPE_LATEST)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                return

        self.temporal = temporal
        self._server = ThreadingHTTPServer((host, port), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="kiln-metrics", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
