"""Health checks and the HTTP endpoints, with injected probes and clocks (no services)."""

from __future__ import annotations

import contextlib
import json
import logging
import select
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, Counter

from outbox_kafka import ConfigurationError
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.serve import (
    FailureLog,
    HealthChecks,
    HttpLimits,
    ObservabilityServer,
    default_max_cycle_age,
)
from tests.support import LogRecords

#: What a test allows beyond a server-side timeout before calling it missed
#: (the accept loop polls every 0.5 s; a loaded CI machine adds some more).
MARGIN = 2.0


@dataclass
class World:
    """What the checks see: a clock, the loop's last cycle, and the two probes' answers."""

    now: float = 1000.0
    last_cycle: float | None = None
    database: str | None = None
    kafka: str | None = None
    database_calls: int = 0
    kafka_calls: int = 0
    timeouts: list[float] = field(default_factory=list)

    def database_problem(self, timeout: float) -> str | None:
        self.database_calls += 1
        self.timeouts.append(timeout)
        return self.database

    def kafka_problem(self, timeout: float) -> str | None:
        self.kafka_calls += 1
        if self.kafka == "raise":
            raise RuntimeError("client exploded")
        return self.kafka

    def checks(self, **kwargs: float) -> HealthChecks:
        return HealthChecks(
            last_cycle_at=lambda: self.last_cycle,
            max_cycle_age=kwargs.pop("max_cycle_age", 10.0),
            database_problem=self.database_problem,
            kafka_problem=self.kafka_problem,
            clock=lambda: self.now,
            **kwargs,
        )


def test_liveness_needs_a_recent_completed_cycle() -> None:
    world = World()
    checks = world.checks(max_cycle_age=10.0)
    status = checks.liveness()
    assert not status.ok and "no cycle completed yet" in status.reason
    world.last_cycle = 995.0
    status = checks.liveness()
    assert status.ok and status.body()["last_cycle_seconds_ago"] == 5.0
    world.now = 1006.0
    status = checks.liveness()
    assert not status.ok
    assert status.body()["status"] == "unavailable"
    assert "no cycle completed for 11.0 s (limit 10 s)" in status.reason


def test_the_liveness_window_covers_a_full_send_and_an_idle_wait() -> None:
    base = {"database_url": "postgresql://u@h/d", "bootstrap_servers": "k:9092"}
    assert default_max_cycle_age(RelaySettings(**base)) == 60.0
    slow_poll = RelaySettings(**base, poll_interval=40.0)
    assert default_max_cycle_age(slow_poll) == 120.0
    short = RelaySettings(**base, lease_seconds=2.0, delivery_timeout_ms=1000)
    assert default_max_cycle_age(short) == 10.0


@pytest.fixture
def health_log() -> Iterator[LogRecords]:
    logger, records = logging.getLogger("outbox_kafka.health"), LogRecords()
    level = logger.level
    logger.addHandler(records)
    logger.setLevel(logging.INFO)
    try:
        yield records
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)


def test_readiness_names_the_failed_check_and_logs_the_drivers_message(
    health_log: LogRecords,
) -> None:
    driver = (
        'checking the database failed: connection to server at "db.internal" (10.1.2.3), '
        'port 5432 failed: FATAL:  password authentication failed for user "orders_relay"'
    )
    world = World(database=driver)
    checks = world.checks(cache_seconds=0.0)
    status = checks.readiness()
    assert not status.ok
    assert status.body() == {
        "status": "unavailable",
        "reason": "database: unreachable",
        "database": "unreachable",
        "kafka": "ok",
    }
    for secret in ("db.internal", "10.1.2.3", "orders_relay", "5432", "FATAL"):
        assert secret not in json.dumps(status.body())
    [failed] = health_log.actions("health_check_failed")
    assert (failed["check"], failed["error"]) == ("database", driver)
    assert failed["levelno"] == logging.WARNING

    world.database, world.kafka = None, "_TRANSPORT: Failed to get metadata: 1/1 brokers are down"
    status = checks.readiness()
    assert not status.ok and status.reason == "kafka: no broker reachable"
    assert status.body()["database"] == "ok"
    world.kafka = "raise"
    assert checks.readiness().body()["kafka"] == "no broker reachable"
    world.kafka = None
    assert checks.readiness().ok
    assert world.timeouts == [2.0] * 4
    failures = [(r["check"], r["error"]) for r in health_log.actions("health_check_failed")]
    assert failures == [
        ("database", driver),
        ("kafka", "_TRANSPORT: Failed to get metadata: 1/1 brokers are down"),
    ]
    recoveries = [r["check"] for r in health_log.actions("health_check_recovered")]
    assert recoveries == ["database", "kafka"]


def test_a_failing_check_is_logged_once_per_change_not_once_per_probe(
    health_log: LogRecords,
) -> None:
    world = World(database="connection refused")
    checks = world.checks(cache_seconds=0.0, log_interval=60.0)
    for _ in range(20):
        world.now += 1.0
        assert not checks.readiness().ok
    assert len(health_log.records) == 1  # 20 probes of the same failure: one line

    world.database = "timeout expired"  # another reason, within the interval: not yet
    for _ in range(20):
        world.now += 1.0
        checks.readiness()
    assert len(health_log.records) == 1
    world.now += 30.0
    checks.readiness()
    [_, again] = health_log.actions("health_check_failed")
    assert (again["error"], again["failed_seconds"]) == ("timeout expired", 69.0)

    world.database = None
    checks.readiness()
    checks.readiness()
    [recovered] = health_log.actions("health_check_recovered")
    assert recovered["check"] == "database" and recovered["levelno"] == logging.INFO
    world.database = "connection refused"  # failing again is news again
    checks.readiness()
    assert len(health_log.actions("health_check_failed")) == 3


def test_the_failure_log_masks_registered_secrets(health_log: LogRecords) -> None:
    from outbox_kafka.logs import register_secrets

    register_secrets(["hunter2-health-secret"])
    FailureLog().record("database", "password hunter2-health-secret rejected")
    [failed] = health_log.actions("health_check_failed")
    assert failed["error"] == "password *** rejected"


def test_readiness_is_cached_so_probes_cannot_hammer_the_dependencies() -> None:
    world = World()
    checks = world.checks(cache_seconds=1.5)
    for _ in range(5):
        assert checks.readiness().ok
    assert (world.database_calls, world.kafka_calls) == (1, 1)
    world.database = "down"
    world.now += 1.0
    assert checks.readiness().ok  # still the cached answer
    world.now += 1.0
    assert not checks.readiness().ok
    assert world.database_calls == 2


# --------------------------------------------------------------------------- HTTP


@pytest.fixture
def served() -> Iterator[tuple[World, CollectorRegistry, ObservabilityServer]]:
    world = World(last_cycle=1000.0)
    registry = CollectorRegistry()
    Counter("outbox_events_published", "test counter", ["topic"], registry=registry).labels(
        topic="orders"
    ).inc(3)
    server = ObservabilityServer(
        registry, world.checks(cache_seconds=0.0), host="127.0.0.1", port=0
    ).start()
    try:
        yield world, registry, server
    finally:
        server.close()


def get(url: str, *, method: str = "GET", accept: str | None = None) -> tuple[int, str, str]:
    request = urllib.request.Request(url, method=method)
    if accept:
        request.add_header("Accept", accept)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.headers["Content-Type"], response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.headers["Content-Type"], exc.read().decode()


def test_metrics_endpoint_serves_the_registry(
    served: tuple[World, CollectorRegistry, ObservabilityServer],
) -> None:
    _, _, server = served
    status, content_type, body = get(server.url("/metrics"))
    assert status == 200 and content_type.startswith("text/plain")
    assert 'outbox_events_published_total{topic="orders"} 3.0' in body
    status, content_type, body = get(
        server.url("/metrics?x=1"), accept="application/openmetrics-text; version=1.0.0"
    )
    assert status == 200 and content_type.startswith("application/openmetrics-text")
    assert body.rstrip().endswith("# EOF")


def test_health_endpoints_answer_200_or_503_with_a_reason(
    served: tuple[World, CollectorRegistry, ObservabilityServer],
) -> None:
    world, _, server = served
    status, content_type, body = get(server.url("/healthz"))
    assert (status, content_type) == (200, "application/json")
    assert json.loads(body)["status"] == "ok"
    assert get(server.url("/readyz"))[0] == 200

    world.now = 2000.0
    world.kafka = "_TRANSPORT: no broker"
    status, _, body = get(server.url("/healthz"))
    assert status == 503 and "no cycle completed for" in json.loads(body)["reason"]
    status, _, body = get(server.url("/readyz"))
    assert status == 503
    assert json.loads(body) == {
        "status": "unavailable",
        "reason": "kafka: no broker reachable",
        "database": "ok",
        "kafka": "no broker reachable",
    }
    assert get(server.url("/readyz"), method="HEAD")[0] == 503


def test_unknown_paths_are_404(
    served: tuple[World, CollectorRegistry, ObservabilityServer],
) -> None:
    _, _, server = served
    for path in ("/", "/metric", "/healthz/x", "/favicon.ico"):
        status, _, body = get(server.url(path))
        assert status == 404, path
        assert json.loads(body)["endpoints"] == ["/metrics", "/healthz", "/readyz"]


def test_a_port_in_use_is_a_configuration_error(
    served: tuple[World, CollectorRegistry, ObservabilityServer],
) -> None:
    world, registry, server = served
    with pytest.raises(
        ConfigurationError, match=f"cannot serve metrics on 127.0.0.1:{server.port}"
    ):
        ObservabilityServer(registry, world.checks(), host="127.0.0.1", port=server.port)


# --------------------------------------------------------------------------- connection limits


@pytest.fixture
def limited() -> Iterator[Callable[..., ObservabilityServer]]:
    """``limited(**limits)``: a started server on loopback with these :class:`HttpLimits`."""
    servers: list[ObservabilityServer] = []

    def start(**limits: Any) -> ObservabilityServer:
        registry = CollectorRegistry()
        Counter("outbox_events_published", "test counter", registry=registry).inc(7)
        world = World(last_cycle=1000.0)
        server = ObservabilityServer(
            registry,
            world.checks(cache_seconds=0.0),
            host="127.0.0.1",
            port=0,
            limits=HttpLimits(**limits),
        ).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def connect(server: ObservabilityServer) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.port), timeout=10)


def seconds_until_closed(sock: socket.socket, limit: float) -> float:
    """How long until the server closes ``sock`` (reads it to EOF); fails after ``limit``."""
    start = time.monotonic()
    sock.settimeout(limit)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        pytest.fail(f"the server left the connection open for more than {limit} s")
    except ConnectionResetError:
        pass  # closed too, abruptly
    return time.monotonic() - start


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP response from ``sock``: status, headers (lower-case names), body."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        assert chunk, f"connection closed mid-response: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
    while len(body) < int(headers["content-length"]):
        chunk = sock.recv(4096)
        assert chunk, "connection closed mid-body"
        body += chunk
    return int(status_line.split()[1]), headers, body


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


def test_the_limits_are_checked() -> None:
    assert HttpLimits() == HttpLimits(
        idle_timeout=10.0, request_timeout=5.0, write_timeout=10.0, max_connections=16
    )
    with pytest.raises(ConfigurationError, match="HTTP idle_timeout must be above 0 seconds"):
        HttpLimits(idle_timeout=0)
    with pytest.raises(ConfigurationError, match="HTTP max_connections must be at least 1"):
        HttpLimits(max_connections=0)


def test_a_silent_connection_is_closed_after_the_idle_timeout(
    limited: Callable[..., ObservabilityServer],
) -> None:
    server = limited(idle_timeout=0.5, request_timeout=5.0)
    with connect(server) as sock:
        wait_for(lambda: server.open_connections == 1, 5, "the server to take the connection")
        waited = seconds_until_closed(sock, 0.5 + MARGIN)
    assert waited >= 0.3, f"closed after {waited:.2f} s, before the idle timeout"
    wait_for(lambda: server.open_connections == 0, 5, "the connection's place to be freed")


def test_an_idle_keep_alive_connection_is_closed_after_the_idle_timeout(
    limited: Callable[..., ObservabilityServer],
) -> None:
    server = limited(idle_timeout=1.0, request_timeout=5.0)
    with connect(server) as sock:
        for _ in range(3):  # requests in quick succession share the connection
            sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: relay\r\n\r\n")
            status, headers, body = read_response(sock)
            assert status == 200 and json.loads(body)["status"] == "ok"
            assert headers["keep-alive"] == "timeout=1" and headers["server"] == "outbox-kafka"
        waited = seconds_until_closed(sock, 1.0 + MARGIN)
    assert waited >= 0.8, f"closed after {waited:.2f} s, before the idle timeout"


def test_half_a_request_is_cut_off_after_the_request_timeout(
    limited: Callable[..., ObservabilityServer],
) -> None:
    server = limited(idle_timeout=10.0, request_timeout=0.5)
    with connect(server) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\nHost: rel")
        waited = seconds_until_closed(sock, 0.5 + MARGIN)
    assert waited >= 0.3, f"closed after {waited:.2f} s, before the request timeout"


def test_a_request_sent_byte_by_byte_is_cut_off_whatever_the_pace(
    limited: Callable[..., ObservabilityServer],
) -> None:
    """Each byte comes well within the timeout; the request as a whole does not."""
    server = limited(idle_timeout=10.0, request_timeout=1.0)
    trickle = b"GET /metrics HTTP/1.1\r\n" + b"X-Padding: " + b"a" * 1000
    with connect(server) as sock:
        start = time.monotonic()
        closed_after: float | None = None
        for byte in trickle:
            try:
                sock.sendall(bytes([byte]))
            except OSError:  # the server closed its end and reset the connection
                closed_after = time.monotonic() - start
                break
            readable, _, _ = select.select([sock], [], [], 0.1)
            if readable:
                with contextlib.suppress(ConnectionResetError):  # closed, abruptly
                    assert sock.recv(4096) == b"", "the server answered a partial request"
                closed_after = time.monotonic() - start
                break
            assert time.monotonic() - start < 1.0 + MARGIN, "still open past the request timeout"
    assert closed_after is not None, "the whole trickle went through"
    assert 0.8 <= closed_after <= 1.0 + MARGIN, closed_after


def test_beyond_max_connections_a_request_is_refused_at_once_and_served_after_idle_ones_go(
    limited: Callable[..., ObservabilityServer],
) -> None:
    server = limited(idle_timeout=1.5, request_timeout=1.5, max_connections=3)
    idle = [connect(server) for _ in range(3)]
    try:
        wait_for(lambda: server.open_connections == 3, 5, "three open connections")
        # Full: a new request gets an immediate 503 (or, at worst, a closed connection).
        for _ in range(5):
            start = time.monotonic()
            try:
                status, _, body = get(server.url("/metrics"))
            except OSError:  # the close overtook the answer: refused all the same
                status, body = 503, '{"status": "busy"}'
            assert time.monotonic() - start < 1.0, "a refusal must not wait for a free place"
            assert status == 503 and json.loads(body)["status"] == "busy"
        assert server.open_connections == 3  # refused ones take no place

        # The idle ones are cut at the idle timeout, and /metrics is served again.
        for sock in idle:
            seconds_until_closed(sock, 1.5 + MARGIN)
        wait_for(lambda: server.open_connections == 0, 5, "the places to be freed")
        status, _, body = get(server.url("/metrics"))
        assert status == 200 and "outbox_events_published_total 7.0" in body
    finally:
        for sock in idle:
            sock.close()


def test_close_ends_open_connections_at_once(
    limited: Callable[..., ObservabilityServer],
) -> None:
    server = limited(idle_timeout=60.0)
    with connect(server) as sock:
        wait_for(lambda: server.open_connections == 1, 5, "the server to take the connection")
        start = time.monotonic()
        server.close()
        assert time.monotonic() - start < 1.0 + MARGIN
        seconds_until_closed(sock, MARGIN)
