"""/healthz and /readyz of a running relay while PostgreSQL or the broker goes and comes back."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka.demo.embedded import EmbeddedBroker
from outbox_kafka.relay import Relay
from outbox_kafka.relay.metrics import RelayMetrics
from outbox_kafka.relay.serve import HealthChecks, ObservabilityServer
from tests.outage_support import DatabaseSwitch
from tests.relay_support import (
    TcpProxy,
    delivered_count,
    enqueue_bulk,
    make_settings,
    running_relay,
    seq_events,
    topic_outbox,
    wait_until,
)
from tests.support import LogRecords


def probe(server: ObservabilityServer, path: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(server.url(path), timeout=15) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def answers(server: ObservabilityServer, path: str, code: int) -> Callable[[], bool]:
    return lambda: probe(server, path)[0] == code


@pytest.fixture
def database_switch(server_url: str, database_url: str) -> Iterator[DatabaseSwitch]:
    switch = DatabaseSwitch(server_url, database_url)
    try:
        yield switch
    finally:
        switch.close()


@pytest.fixture
def serve() -> Iterator[Callable[[Relay, float], ObservabilityServer]]:
    """``serve(relay, max_cycle_age)``: the relay's endpoints on a free loopback port."""
    servers: list[ObservabilityServer] = []

    def start(relay: Relay, max_cycle_age: float) -> ObservabilityServer:
        checks = HealthChecks.for_relay(relay, max_cycle_age=max_cycle_age)
        server = ObservabilityServer(
            relay.metrics.registry, checks, host="127.0.0.1", port=0
        ).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def test_database_outage_makes_the_relay_unready_and_then_unhealthy(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    database_switch: DatabaseSwitch,
    serve: Callable[[Relay, float], ObservabilityServer],
) -> None:
    topic = new_topic(1)
    outbox = topic_outbox()
    relay = Relay(make_settings(database_url, kafka_bootstrap), metrics=RelayMetrics())
    server = serve(relay, 3.0)
    status, body = probe(server, "/healthz")
    assert status == 503 and "no cycle completed yet" in str(body["reason"])

    with running_relay(relay) as thread:
        wait_until(answers(server, "/healthz", 200), 30, what="healthy")
        wait_until(answers(server, "/readyz", 200), 30, what="ready")
        assert probe(server, "/readyz")[1] == {"status": "ok", "database": "ok", "kafka": "ok"}

        database_switch.down()
        wait_until(answers(server, "/readyz", 503), 30, what="unready without the database")
        body = probe(server, "/readyz")[1]
        assert body == {
            "status": "unavailable",
            "reason": "database: unreachable",
            "database": "unreachable",
            "kafka": "ok",
        }
        # The loop cannot claim, so it stops completing cycles.
        wait_until(answers(server, "/healthz", 503), 30, what="unhealthy without the database")
        assert "no cycle completed for" in str(probe(server, "/healthz")[1]["reason"])

        database_switch.up()
        wait_until(answers(server, "/readyz", 200), 30, what="ready again")
        wait_until(answers(server, "/healthz", 200), 30, what="healthy again")
        enqueue_bulk(engine, outbox, seq_events(topic, ["a", "b"], 4))
        wait_until(lambda: delivered_count(engine) == 4, 30, what="delivery after the outage")
        assert thread.error is None


def test_broker_outage_makes_the_relay_unready_but_it_stays_alive(
    database_url: str,
    proxied_broker: tuple[TcpProxy, EmbeddedBroker],
    serve: Callable[[Relay, float], ObservabilityServer],
) -> None:
    proxy, broker = proxied_broker
    relay = Relay(make_settings(database_url, broker.bootstrap), metrics=RelayMetrics())
    server = serve(relay, 3.0)
    with running_relay(relay) as thread:
        wait_until(answers(server, "/readyz", 200), 30, what="ready")

        proxy.cut()
        wait_until(answers(server, "/readyz", 503), 30, what="unready without the broker")
        assert probe(server, "/readyz")[1]["database"] == "ok"
        body = probe(server, "/readyz")[1]
        assert body["reason"] == "kafka: no broker reachable"
        # Nothing to send: the loop keeps turning, so a restart would not help.
        assert probe(server, "/healthz")[0] == 200

        proxy.restore()
        wait_until(answers(server, "/readyz", 200), 60, what="ready again")
        assert probe(server, "/healthz")[0] == 200
        assert thread.error is None


@pytest.fixture
def health_log() -> Iterator[LogRecords]:
    """The records of the health checks' logger (it may not propagate to the root)."""
    logger, records = logging.getLogger("outbox_kafka.health"), LogRecords()
    logger.addHandler(records)
    try:
        yield records
    finally:
        logger.removeHandler(records)


@pytest.mark.parametrize("broken", ["database name", "user name", "closed port"])
def test_readyz_names_the_failed_database_check_but_not_the_drivers_message(
    broken: str,
    server_url: str,
    kafka_bootstrap: str,
    health_log: LogRecords,
    serve: Callable[[Relay, float], ObservabilityServer],
) -> None:
    tag = uuid.uuid4().hex[:8]
    url = make_url(server_url)
    if broken == "database name":
        url = url.set(database=f"outbox_missing_{tag}")
        expected = [f"outbox_missing_{tag}", "does not exist"]
    elif broken == "user name":
        url = url.set(username=f"outbox_nobody_{tag}")
        expected = [f"outbox_nobody_{tag}"]
    else:
        url = url.set(port=1)  # nothing listens on port 1
        # Over TCP, or through a socket directory (the embedded server's URL).
        tcp = not url.query.get("host")
        expected = [str(url.host), "port 1 failed"] if tcp else [".s.PGSQL.1"]
    relay = Relay(
        make_settings(url.render_as_string(hide_password=False), kafka_bootstrap),
        metrics=RelayMetrics(),
    )
    try:
        server = serve(relay, 60.0)
        server.checks.cache_seconds = 0.0  # every probe runs the checks
        wait_until(
            lambda: probe(server, "/readyz")[1].get("kafka") == "ok", 30, what="the broker check"
        )
        for _ in range(5):
            status, body = probe(server, "/readyz")
            assert status == 503
            assert body == {
                "status": "unavailable",
                "reason": "database: unreachable",
                "database": "unreachable",
                "kafka": "ok",
            }
        with urllib.request.urlopen(server.url("/metrics"), timeout=15) as response:
            metrics = response.read().decode()
        for leak in {*expected, str(url.host), str(url.username), "FATAL", "connection to"}:
            assert leak not in json.dumps(body), leak
            assert leak not in metrics, leak
    finally:
        relay.close()

    # The relay's log has the driver's message, once for all those probes.
    failed = [r for r in health_log.records if getattr(r, "action", None) == "health_check_failed"]
    assert len(failed) == 1, [r.__dict__ for r in failed]
    error = str(failed[0].error)  # type: ignore[attr-defined]
    assert failed[0].check == "database"  # type: ignore[attr-defined]
    assert error.startswith("checking the database failed: ")
    for part in expected:
        assert part in error, (part, error)
