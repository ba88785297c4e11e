"""Health checks and the HTTP endpoints, with injected probes and clocks (no services)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, Counter

from outbox_kafka import ConfigurationError
from outbox_kafka.health import HealthChecks, default_max_cycle_age
from outbox_kafka.http_server import ObservabilityServer
from outbox_kafka.settings import RelaySettings


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


def test_readiness_names_each_unreachable_dependency() -> None:
    world = World(database="checking the database failed: connection refused")
    checks = world.checks(cache_seconds=0.0)
    status = checks.readiness()
    assert not status.ok
    assert status.body()["database"] == "checking the database failed: connection refused"
    assert status.body()["kafka"] == "ok"
    assert status.reason.startswith("database: ")
    world.database, world.kafka = None, "_TRANSPORT: Failed to get metadata"
    status = checks.readiness()
    assert not status.ok and status.reason == "kafka: _TRANSPORT: Failed to get metadata"
    world.kafka = "raise"
    assert checks.readiness().body()["kafka"] == "RuntimeError: client exploded"
    world.kafka = None
    assert checks.readiness().ok
    assert world.timeouts == [2.0] * 4


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
        "reason": "kafka: _TRANSPORT: no broker",
        "database": "ok",
        "kafka": "_TRANSPORT: no broker",
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
