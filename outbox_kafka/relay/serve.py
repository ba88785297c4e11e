"""The relay's HTTP endpoints: ``/metrics``, ``/healthz`` and ``/readyz``, the
checks behind the health endpoints, and the bounds of each connection to them.

A stdlib ``ThreadingHTTPServer`` in a daemon thread: a slow probe never
blocks a scrape, and nothing here touches the relay loop. ``/metrics`` serves
the relay's registry in the format the scraper asks for (Prometheus text or
OpenMetrics); the health endpoints answer 200 or 503 with a JSON body that
names the failed check. Any other path is 404.

Every connection is bounded (:class:`HttpLimits`): a client has
``idle_timeout`` seconds to start a request (on a new connection or between
keep-alive requests) and ``request_timeout`` seconds from its first byte to
the end of its headers, and each write of an answer must finish within
``write_timeout``; past that the connection is closed (:class:`DeadlineReader`,
:class:`TimedWriter`). At most ``max_connections`` connections are served at
once; the accepting thread answers any further one with a short 503 and closes
it, without waiting.

Liveness: the loop completed a cycle within the last ``max_cycle_age``
seconds (an idle relay completes one every poll interval; a cycle stuck on
an unreachable database does not complete). Readiness: ``SELECT 1`` answers
and a broker returns cluster metadata, each within ``timeout``; the result is
kept for ``cache_seconds`` so frequent probes cost one check
(:class:`HealthChecks`).

A failed dependency check answers with a fixed phrase per check
(``"database": "unreachable"``), never the driver's or client's message:
those name hosts, ports, users and databases, and the endpoints answer
anyone who can reach the port. The full reason goes to the relay's log
instead: once when a check starts failing, once when it recovers, and while
it keeps failing only when the reason changes, at most once per
``log_interval`` seconds (:class:`FailureLog`).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from outbox_kafka.errors import ConfigurationError, StorageError
from outbox_kafka.logs import redact
from outbox_kafka.relay.group import outbox_labelled_registry
from outbox_kafka.relay.metrics import Monitor

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

    from outbox_kafka.relay.config import RelaySettings
    from outbox_kafka.relay.group import RelayGroup
    from outbox_kafka.relay.log_relay import LogRelay
    from outbox_kafka.relay.loop import Relay


log = logging.getLogger("outbox_kafka.http")

DEFAULT_PORT = 9400
DEFAULT_HOST = "0.0.0.0"
ENDPOINTS = ("/metrics", "/healthz", "/readyz")

#: What a connection beyond ``max_connections`` gets before it is closed.
_BUSY_BODY = b'{"status": "busy", "reason": "too many open connections"}'
_BUSY_RESPONSE = (
    b"HTTP/1.1 503 Service Unavailable\r\n"
    b"Content-Type: application/json\r\n"
    b"Content-Length: " + str(len(_BUSY_BODY)).encode() + b"\r\n"
    b"Retry-After: 1\r\n"
    b"Cache-Control: no-store\r\n"
    b"Connection: close\r\n"
    b"\r\n" + _BUSY_BODY
)
#: Refused connections are logged at most once per this many seconds.
_REFUSAL_LOG_INTERVAL = 60.0


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    server_version = "outbox-kafka"

    def version_string(self) -> str:
        """The Server header: no Python or library version for unauthenticated callers."""
        return self.server_version

    def setup(self) -> None:
        """Wrap the connection in a deadline-bound reader and a time-bound writer."""
        self.connection = self.request
        self._reader = DeadlineReader(self.connection, self.server.limits)
        self.rfile = io.BufferedReader(self._reader)
        self.wfile = TimedWriter(self.connection, self.server.limits.write_timeout)

    def handle_one_request(self) -> None:
        self._reader.expect_request()
        super().handle_one_request()

    def do_GET(self) -> None:
        self._respond(send_body=True)

    def do_HEAD(self) -> None:
        self._respond(send_body=False)

    def _respond(self, *, send_body: bool) -> None:
        if self.headers.get("Content-Length", "0").strip() != "0" or self.headers.get(
            "Transfer-Encoding"
        ):
            # A body is never read; it must not be taken for the next request.
            self.close_connection = True
        path = self.path.split("?", 1)[0]
        try:
            code, content_type, body = self._answer(path)
        except Exception:
            log.exception("HTTP request failed", extra={"action": "http_error", "path": path})
            code, content_type, body = 500, "text/plain; charset=utf-8", b"internal error\n"
        self._send(code, content_type, body, send_body)

    def _answer(self, path: str) -> tuple[int, str, bytes]:
        """The status, content type and body for ``path``."""
        if path == "/metrics":
            encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
            return 200, content_type, encoder(self.server.registry)
        if path == "/healthz":
            return self._status_answer(self.server.checks.liveness())
        if path == "/readyz":
            return self._status_answer(self.server.checks.readiness())
        body = json.dumps({"status": "not found", "endpoints": ENDPOINTS}).encode()
        return 404, "application/json", body

    @staticmethod
    def _status_answer(status: HealthStatus) -> tuple[int, str, bytes]:
        body = json.dumps(status.body()).encode()
        return 200 if status.ok else 503, "application/json", body

    def _send(self, code: int, content_type: str, body: bytes, send_body: bool) -> None:
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        idle_seconds = int(self.server.limits.idle_timeout)
        if self.close_connection:
            self.send_header("Connection", "close")
        elif idle_seconds:
            # Tells keep-alive clients when the server drops an idle connection.
            self.send_header("Keep-Alive", f"timeout={idle_seconds}")
        self.end_headers()
        if send_body:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        # Requests (and timed-out connections) go to the relay's logs (debug), not to stderr.
        log.debug(
            "HTTP request",
            extra={
                "action": "http_request",
                "client": self.client_address[0],
                "request": format % args,
            },
        )


class _Server(ThreadingHTTPServer):
    """A thread per connection, at most ``limits.max_connections`` of them at once."""

    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        registry: CollectorRegistry,
        checks: HealthChecks,
        limits: HttpLimits,
    ) -> None:
        self.registry = registry
        self.checks = checks
        self.limits = limits
        self._lock = threading.Lock()
        self._open: set[socket.socket] = set()
        self._closing = False
        self._refused = 0
        self._refusals_logged_at: float | None = None
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, _Handler)

    @property
    def open_connections(self) -> int:
        """Connections being served right now."""
        with self._lock:
            return len(self._open)

    def process_request(self, request: Any, client_address: Any) -> None:
        """Serve ``request`` in a thread of its own, or refuse it when the server is full."""
        with self._lock:
            admitted = not self._closing and len(self._open) < self.limits.max_connections
            if admitted:
                self._open.add(request)
        if not admitted:
            self._refuse(request, client_address)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        """Serve one connection to its end, then free its place."""
        try:
            self.finish_request(request, client_address)
        except Exception:
            self.handle_error(request, client_address)
        finally:
            self._forget(request)
            self.shutdown_request(request)

    def _forget(self, request: socket.socket) -> None:
        with self._lock:
            self._open.discard(request)

    def _refuse(self, request: socket.socket, client_address: Any) -> None:
        """Answer 503 if the socket takes it at once, and close; never blocks."""
        try:
            request.setblocking(False)
            request.send(_BUSY_RESPONSE)
            # Closing with unread bytes would reset the connection and could
            # discard the answer before the client reads it: take what has come.
            for _ in range(16):
                if not request.recv(4096):
                    break
        except OSError:  # BlockingIOError once nothing more has arrived
            pass
        self.shutdown_request(request)
        now = time.monotonic()
        self._refused += 1
        logged_at = self._refusals_logged_at
        if logged_at is None or now - logged_at >= _REFUSAL_LOG_INTERVAL:
            log.warning(
                "HTTP connections refused: too many open connections",
                extra={
                    "action": "http_refused",
                    "client": client_address[0] if client_address else "",
                    "refused": self._refused,
                    "max_connections": self.limits.max_connections,
                },
            )
            self._refused = 0
            self._refusals_logged_at = now

    def close_connections(self) -> None:
        """Refuse new connections and end the open ones (their threads then finish)."""
        with self._lock:
            self._closing = True
            for request in self._open:
                with contextlib.suppress(OSError):  # already gone
                    request.shutdown(socket.SHUT_RDWR)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """Log a connection that ended in an exception (instead of printing to stderr)."""
        exc = sys.exc_info()[1]
        client = client_address[0] if client_address else ""
        if isinstance(exc, OSError):
            # The client went away or stopped reading: routine, not the relay's fault.
            log.debug(
                "HTTP connection ended",
                extra={"action": "http_disconnect", "client": client, "error": str(exc)},
            )
        else:
            log.exception(
                "HTTP connection failed", extra={"action": "http_error", "client": client}
            )


class ObservabilityServer:
    """Serves ``/metrics``, ``/healthz`` and ``/readyz`` until :meth:`close`.

    The socket is bound in the constructor (``port=0`` picks a free port, see
    :attr:`port`), so a port already in use is a :class:`ConfigurationError`
    before anything starts. ``limits`` bounds connections (see :class:`HttpLimits`).
    """

    def __init__(
        self,
        registry: CollectorRegistry,
        checks: HealthChecks,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        limits: HttpLimits | None = None,
    ) -> None:
        self.limits = limits or HttpLimits()
        try:
            self._server = _Server((host, port), registry, checks, self.limits)
        except (OSError, OverflowError) as exc:
            raise ConfigurationError(f"cannot serve metrics on {host}:{port}: {exc}") from None
        self.host = host
        self.port: int = self._server.server_address[1]
        self.checks = checks
        self._thread: threading.Thread | None = None

    @classmethod
    def for_relay(
        cls,
        relay: Relay,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        limits: HttpLimits | None = None,
    ) -> ObservabilityServer:
        """A server for ``relay``'s registry and health checks (not started yet)."""
        checks = HealthChecks.for_relay(relay)
        try:
            return cls(relay.metrics.registry, checks, host=host, port=port, limits=limits)
        except BaseException:
            checks.close()
            raise

    @classmethod
    def for_log_relay(
        cls,
        relay: LogRelay,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        limits: HttpLimits | None = None,
    ) -> ObservabilityServer:
        """A server for a log-mode relay's registry and health checks (not started yet)."""
        checks = HealthChecks.for_log_relay(relay)
        try:
            return cls(relay.metrics.registry, checks, host=host, port=port, limits=limits)
        except BaseException:
            checks.close()
            raise

    @classmethod
    def for_group(
        cls,
        group: RelayGroup,
        *,
        host: str = DEFAULT_HOST,
        port: int = DEFAULT_PORT,
        limits: HttpLimits | None = None,
    ) -> ObservabilityServer:
        """A server for a multi-outbox relay: every outbox's metrics, labelled ``outbox``."""
        checks = HealthChecks.for_group(group)
        try:
            registry = outbox_labelled_registry(group.registries, group.shared_registry)
            return cls(registry, checks, host=host, port=port, limits=limits)
        except BaseException:
            checks.close()
            raise

    @property
    def open_connections(self) -> int:
        """Connections being served right now (at most ``limits.max_connections``)."""
        return self._server.open_connections

    def url(self, path: str = "/metrics") -> str:
        """The URL of ``path`` on this server (loopback when it listens on all interfaces)."""
        shown = "127.0.0.1" if self.host in ("", "0.0.0.0") else self.host
        return f"http://{shown}:{self.port}{path}"

    def start(self) -> ObservabilityServer:
        """Start serving in a daemon thread; returns ``self``."""
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="outbox-http", daemon=True
        )
        self._thread.start()
        log.info(
            "serving metrics and health endpoints",
            extra={
                "action": "http_start",
                "host": self.host,
                "port": self.port,
                "idle_timeout": self.limits.idle_timeout,
                "request_timeout": self.limits.request_timeout,
                "max_connections": self.limits.max_connections,
            },
        )
        return self

    def close(self) -> None:
        """Stop serving, end open connections, release the port and the checks' connections."""
        if self._thread is not None:
            self._server.shutdown()
            self._thread.join(5)
            self._thread = None
        self._server.close_connections()
        self._server.server_close()
        self.checks.close()


@dataclass(frozen=True)
class HttpLimits:
    """How long a connection may take and how many are served at once.

    ``idle_timeout``: seconds a connection may stay silent before a request
    starts (a new connection, or a keep-alive one between requests).
    ``request_timeout``: seconds from a request's first byte to the end of its
    headers, so a request sent in dribs is cut off too. ``write_timeout``:
    seconds each write of an answer may take (a client that stops reading is
    dropped). ``max_connections``: connections served at once; more are
    answered 503 and closed at once.
    """

    #: Above the shipped Prometheus scrape interval (5 s), so a scraper keeps
    #: one connection instead of racing the server's close at every scrape.
    idle_timeout: float = 10.0
    request_timeout: float = 5.0
    write_timeout: float = 10.0
    max_connections: int = 16

    def __post_init__(self) -> None:
        for name in ("idle_timeout", "request_timeout", "write_timeout"):
            value = getattr(self, name)
            if not value > 0:
                raise ConfigurationError(f"HTTP {name} must be above 0 seconds, got {value}")
        if self.max_connections < 1:
            raise ConfigurationError(
                f"HTTP max_connections must be at least 1, got {self.max_connections}"
            )


class DeadlineReader(io.RawIOBase):
    """Reads a socket within a deadline rather than a per-read timeout.

    :meth:`expect_request` gives the next request ``idle_timeout`` seconds to
    begin; its first byte moves the deadline to ``request_timeout`` from then.
    A read past the deadline raises :class:`TimeoutError`, which the request
    handler treats as "close this connection".
    """

    def __init__(
        self,
        sock: socket.socket,
        limits: HttpLimits,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._sock = sock
        self._limits = limits
        self._clock = clock
        self._deadline = clock() + limits.idle_timeout
        self._started = False

    def expect_request(self) -> None:
        """Start waiting for a new request: ``idle_timeout`` from now until its first byte."""
        self._deadline = self._clock() + self._limits.idle_timeout
        self._started = False

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer) -> int:
        remaining = self._deadline - self._clock()
        if remaining <= 0:
            raise TimeoutError(self._overdue())
        self._sock.settimeout(remaining)
        try:
            count = self._sock.recv_into(buffer)
        except TimeoutError:
            raise TimeoutError(self._overdue()) from None
        if count and not self._started:
            self._started = True
            self._deadline = self._clock() + self._limits.request_timeout
        return count

    def _overdue(self) -> str:
        if self._started:
            return f"request not complete within {self._limits.request_timeout:g} s"
        return f"no request within {self._limits.idle_timeout:g} s"


class TimedWriter(io.BufferedIOBase):
    """Writes to a socket, each write bounded by ``timeout`` seconds in total."""

    def __init__(self, sock: socket.socket, timeout: float) -> None:
        super().__init__()
        self._sock = sock
        self._timeout = timeout

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer) -> int:
        view = memoryview(data)
        self._sock.settimeout(self._timeout)
        try:
            self._sock.sendall(view)
        except TimeoutError:
            raise TimeoutError(f"answer not sent within {self._timeout:g} s") from None
        return view.nbytes

    def fileno(self) -> int:
        return self._sock.fileno()


health_log = logging.getLogger("outbox_kafka.health")

OK = "ok"
#: What ``/readyz`` says about a failed check; the cause is in the relay's log.
DATABASE_FAILURE = "unreachable"
KAFKA_FAILURE = "no broker reachable"
#: What ``/readyz`` says about an outbox whose loop failed and waits for its restart.
LOOP_FAILURE = "failed, restarting"


@dataclass(frozen=True)
class HealthStatus:
    """The answer to one probe; ``details`` maps each part checked to ``"ok"`` or what failed.

    Everything here may be shown to an unauthenticated caller: dependency
    failures are fixed phrases, their causes are only logged.
    """

    ok: bool
    details: dict[str, object] = field(default_factory=dict)

    @property
    def reason(self) -> str:
        """Why it is not ok (empty when ok)."""
        return "; ".join(
            f"{name}: {value}"
            for name, value in self.details.items()
            if isinstance(value, str) and value != OK
        )

    def body(self) -> dict[str, object]:
        """The JSON answer: ``status``, ``reason`` when not ok, then ``details``."""
        body: dict[str, object] = {"status": "ok" if self.ok else "unavailable"}
        if not self.ok:
            body["reason"] = self.reason
        body.update(self.details)
        return body


def default_max_cycle_age(settings: RelaySettings) -> float:
    """How long without a completed cycle means the loop is stuck.

    A cycle sends for at most the delivery timeout (≤ 80% of the lease), and
    an idle relay completes one at least every poll interval.
    """
    return max(2.0 * settings.lease_seconds, 3.0 * settings.poll_interval, 10.0)


@dataclass
class _Failing:
    """A check that is failing: since when, and the reason last logged and when."""

    since: float
    reason: str
    logged_at: float


class FailureLog:
    """Logs why dependency checks fail without a line per probe.

    A check that starts failing is logged at once (warning, with the full
    reason); while it keeps failing, a different reason is logged at most
    once per ``interval`` seconds and the same reason never again; a recovery
    is logged once (info). Safe to call from several threads.
    """

    def __init__(self, interval: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._lock = threading.Lock()
        self._failing: dict[str, _Failing] = {}

    def record(self, check: str, problem: str | None) -> None:
        """Note the outcome of ``check``: None when it passed, else the full reason."""
        with self._lock:
            now = self._clock()
            failing = self._failing.get(check)
            if problem is None:
                if failing is not None:
                    del self._failing[check]
                    health_log.info(
                        "health check recovered",
                        extra={
                            "action": "health_check_recovered",
                            "check": check,
                            "failed_seconds": round(now - failing.since, 3),
                        },
                    )
                return
            problem = redact(problem)
            if failing is None:
                self._failing[check] = _Failing(since=now, reason=problem, logged_at=now)
                health_log.warning(
                    "health check failed",
                    extra={"action": "health_check_failed", "check": check, "error": problem},
                )
            elif problem != failing.reason and now - failing.logged_at >= self.interval:
                failing.reason, failing.logged_at = problem, now
                health_log.warning(
                    "health check still failing",
                    extra={
                        "action": "health_check_failed",
                        "check": check,
                        "error": problem,
                        "failed_seconds": round(now - failing.since, 3),
                    },
                )


def _pinging(monitor: Monitor) -> Callable[[float], str | None]:
    """A database check by ``monitor``: None when it answers, else why not."""

    def database_problem(timeout: float) -> str | None:
        try:
            monitor.ping(timeout)
        except StorageError as exc:
            return str(exc)
        return None

    return database_problem


def _loop_check(group: RelayGroup, name: str) -> Callable[[float], str | None]:
    """The check of outbox ``name``'s loop: None while it runs, else why it failed."""

    def loop_problem(timeout: float) -> str | None:
        return group.loop_problem(name)

    return loop_problem


class HealthChecks:
    """The checks behind ``/healthz`` and ``/readyz``; every dependency is injectable."""

    def __init__(
        self,
        *,
        last_cycle_at: Callable[[], float | None],
        max_cycle_age: float,
        database_problem: Callable[[float], str | None]
        | Mapping[str, Callable[[float], str | None]],
        kafka_problem: Callable[[float], str | None],
        loop_problem: Mapping[str, Callable[[float], str | None]] | None = None,
        loop_failure: str | Callable[[], str] = LOOP_FAILURE,
        timeout: float = 2.0,
        cache_seconds: float = 1.5,
        log_interval: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
        on_close: Callable[[], None] | None = None,
    ) -> None:
        self._last_cycle_at = last_cycle_at
        self.max_cycle_age = max_cycle_age
        #: Each check's name, how it runs and what a failure says: ``database``, or
        #: ``database:<outbox>`` per outbox of a multi-outbox relay, and then its
        #: ``loop:<outbox>`` (the loop is not failed); then ``kafka``.
        databases = (
            [(f"database:{name}", check) for name, check in database_problem.items()]
            if isinstance(database_problem, Mapping)
            else [("database", database_problem)]
        )
        self._checks = [
            *((name, check, DATABASE_FAILURE) for name, check in databases),
            *(
                (f"loop:{name}", check, loop_failure)
                for name, check in (loop_problem or {}).items()
            ),
            ("kafka", kafka_problem, KAFKA_FAILURE),
        ]
        self.timeout = timeout
        self.cache_seconds = cache_seconds
        self._clock = clock
        self._on_close = on_close
        self._lock = threading.Lock()
        self._cached: tuple[float, HealthStatus] | None = None
        self.failures = FailureLog(log_interval, clock)

    @classmethod
    def for_relay(cls, relay: Relay, *, max_cycle_age: float | None = None) -> HealthChecks:
        """Checks for ``relay``: its loop, a database connection of their own, its producer."""
        settings = relay.settings
        monitor = Monitor.connect(settings.database_url, settings.names)
        return cls(
            last_cycle_at=lambda: relay.last_cycle_at,
            max_cycle_age=default_max_cycle_age(settings)
            if max_cycle_age is None
            else max_cycle_age,
            database_problem=_pinging(monitor),
            kafka_problem=relay.publisher.broker_problem,
            on_close=monitor.close,
        )

    @classmethod
    def for_log_relay(cls, relay: LogRelay) -> HealthChecks:
        """Checks for a log-mode relay: its loop (a stall or a busy slot is not ready), a
        database connection of their own, its producer."""
        settings = relay.settings
        monitor = Monitor.connect(settings.database_url, settings.names)
        return cls(
            last_cycle_at=lambda: relay.last_cycle_at,
            max_cycle_age=default_max_cycle_age(settings),
            database_problem=_pinging(monitor),
            kafka_problem=relay.kafka_problem,
            loop_problem={"log": relay.loop_problem},
            loop_failure=relay.problem_kind,
            on_close=monitor.close,
        )

    @classmethod
    def for_group(cls, group: RelayGroup) -> HealthChecks:
        """Checks for a multi-outbox relay: every loop, every outbox's database, the producer.

        Liveness fails when a loop is stuck (not when it waits for its
        database or for its restart: see :meth:`RelayGroup.last_cycle_at`);
        readiness names each outbox's database check, ``database:<outbox>``,
        and its loop, ``loop:<outbox>``: not ready from an unexpected error in
        the loop until the loop started in its place completes a cycle.
        """
        monitors: dict[str, Monitor] = {}

        def close() -> None:
            for monitor in monitors.values():
                monitor.close()

        try:
            for name, relay in group.relays.items():
                monitors[name] = Monitor.connect(relay.settings.database_url, relay.settings.names)
        except BaseException:
            close()
            raise

        return cls(
            last_cycle_at=group.last_cycle_at,
            # The slowest loop's: the outboxes may have leases and poll intervals of their own.
            max_cycle_age=max(default_max_cycle_age(r.settings) for r in group.relays.values()),
            database_problem={name: _pinging(m) for name, m in monitors.items()},
            kafka_problem=group.publisher.broker_problem,
            loop_problem={name: _loop_check(group, name) for name in group.relays},
            on_close=close,
        )

    def liveness(self) -> HealthStatus:
        """Ok when the loop completed a cycle within ``max_cycle_age`` seconds."""
        at = self._last_cycle_at()
        if at is None:
            return HealthStatus(False, {"loop": "no cycle completed yet"})
        age = max(0.0, self._clock() - at)
        details: dict[str, object] = {"last_cycle_seconds_ago": round(age, 3)}
        if age > self.max_cycle_age:
            details["loop"] = (
                f"no cycle completed for {age:.1f} s (limit {self.max_cycle_age:.0f} s)"
            )
            return HealthStatus(False, details)
        return HealthStatus(True, {"loop": OK, **details})

    def readiness(self) -> HealthStatus:
        """Ok when the database and a Kafka broker answer; cached for ``cache_seconds``."""
        with self._lock:
            now = self._clock()
            if self._cached is not None and now - self._cached[0] < self.cache_seconds:
                return self._cached[1]
            status = self._check_dependencies()
            self._cached = (self._clock(), status)
            return status

    def _check_dependencies(self) -> HealthStatus:
        """Run each dependency check; the answer names failed checks, the log says why."""
        details: dict[str, object] = {}
        for name, check, failure in self._checks:
            try:
                problem = check(self.timeout)
            except Exception as exc:  # a probe must answer, whatever the client raised
                problem = f"{type(exc).__name__}: {exc}"
            self.failures.record(name, problem)
            if problem is None:
                details[name] = OK
            else:
                details[name] = failure() if callable(failure) else failure
        return HealthStatus(all(v == OK for v in details.values()), details)

    def close(self) -> None:
        """Release what the checks hold (the database connection of their own)."""
        if self._on_close is not None:
            self._on_close()
