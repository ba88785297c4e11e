"""The relay's HTTP endpoints: ``/metrics``, ``/healthz`` and ``/readyz``.

A stdlib ``ThreadingHTTPServer`` in a daemon thread: a slow probe never
blocks a scrape, and nothing here touches the relay loop. ``/metrics`` serves
the relay's registry in the format the scraper asks for (Prometheus text or
OpenMetrics); the health endpoints answer 200 or 503 with a JSON body that
says why. Any other path is 404.
"""

from __future__ import annotations

import json
import logging
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from .errors import ConfigurationError
from .health import HealthChecks, HealthStatus

if TYPE_CHECKING:
    from .relay import Relay

log = logging.getLogger("outbox_kafka.http")

DEFAULT_PORT = 9400
DEFAULT_HOST = "0.0.0.0"
ENDPOINTS = ("/metrics", "/healthz", "/readyz")


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def do_GET(self) -> None:
        self._respond(send_body=True)

    def do_HEAD(self) -> None:
        self._respond(send_body=False)

    def _respond(self, *, send_body: bool) -> None:
        path = self.path.split("?", 1)[0]
        try:
            if path == "/metrics":
                encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                self._send(200, content_type, encoder(self.server.registry), send_body)
            elif path == "/healthz":
                self._send_status(self.server.checks.liveness(), send_body)
            elif path == "/readyz":
                self._send_status(self.server.checks.readiness(), send_body)
            else:
                body = json.dumps({"status": "not found", "endpoints": ENDPOINTS}).encode()
                self._send(404, "application/json", body, send_body)
        except Exception:
            log.exception("HTTP request failed", extra={"action": "http_error", "path": path})
            self._send(500, "text/plain; charset=utf-8", b"internal error\n", send_body)

    def _send_status(self, status: HealthStatus, send_body: bool) -> None:
        body = json.dumps(status.body()).encode()
        self._send(200 if status.ok else 503, "application/json", body, send_body)

    def _send(self, code: int, content_type: str, body: bytes, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Requests go to the relay's logs (debug), not to stderr as raw text.
        log.debug(
            "HTTP request",
            extra={
                "action": "http_request",
                "client": self.client_address[0],
                "request": format % args,
            },
        )


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self, address: tuple[str, int], registry: CollectorRegistry, checks: HealthChecks
    ) -> None:
        self.registry = registry
        self.checks = checks
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)


class ObservabilityServer:
    """Serves ``/metrics``, ``/healthz`` and ``/readyz`` until :meth:`close`.

    The socket is bound in the constructor (``port=0`` picks a free port, see
    :attr:`port`), so a port already in use is a :class:`ConfigurationError`
    before anything starts.
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        checks: HealthChecks,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
    ) -> None:
        try:
            self._server = _Server((host, port), registry, checks)
        except (OSError, OverflowError) as exc:
            raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc}") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        self.checks = checks
        self._thread: threading.Thread | None = None

    @classmethod
    def for_relay(
        cls, relay: Relay, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT
    ) -> ObservabilityServer:
        """A server for ``relay``'s registry and health checks (not started yet)."""
        checks = HealthChecks.for_relay(relay)
        try:
            return cls(relay.metrics.registry, checks, host=host, port=port)
        except BaseException:
            checks.close()
            raise

    def url(self, path: str = "/metrics") -> str:
        shown = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{shown}:{self.port}{path}"

    def start(self) -> ObservabilityServer:
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="outbox-http", daemon=True
        )
        self._thread.start()
        log.info(
            "serving metrics and health endpoints",
            extra={"action": "http_start", "host": self.host, "port": self.port},
        )
        return self

    def close(self) -> None:
        """Stop serving and release the port and the checks' connections."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
        self._server.server_close()
        self.checks.close()
