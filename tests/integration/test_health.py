"""/healthz and /readyz of a running relay while PostgreSQL or the broker goes and comes back."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator

import pytest
import sqlalchemy as sa

from outbox_kafka.embedded import EmbeddedBroker
from outbox_kafka.health import HealthChecks
from outbox_kafka.http_server import ObservabilityServer
from outbox_kafka.metrics import RelayMetrics
from outbox_kafka.relay import Relay
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
        assert body["kafka"] == "ok"
        assert "checking the database failed" in str(body["database"])
        assert str(body["reason"]).startswith("database: ")
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
        assert str(body["reason"]).startswith("kafka: ")
        # Nothing to send: the loop keeps turning, so a restart would not help.
        assert probe(server, "/healthz")[0] == 200

        proxy.restore()
        wait_until(answers(server, "/readyz", 200), 60, what="ready again")
        assert probe(server, "/healthz")[0] == 200
        assert thread.error is None
