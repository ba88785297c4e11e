"""PostgreSQL goes away under a relay process: its sessions terminated, then the server restarted.

The database is on a PostgreSQL server the test starts itself (never the
machine's own), so it can be stopped and started again on the same port. The
relay's connections carry ``application_name=outbox-relay`` so that
``pg_terminate_backend`` hits only them; the writers keep writing (and retry
their own failed transactions). The relay must reconnect by itself, with
backoff, and record nothing wrongly: every event ends delivered once in the
database, and where the database says Kafka put it, Kafka has it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_kafka import migrate
from outbox_kafka.database import make_engine
from tests.relay_support import delivered_count, outbox_summary, wait_until
from tests.reliability.harness import (
    Collector,
    ReadinessWatch,
    RecoveryClock,
    RelayProcess,
    Writer,
    audit,
    check_writer,
    wait_all_delivered,
)
from tests.reliability.report import seconds, size
from tests.reliability.servers import PrivatePostgres


@pytest.fixture
def private_database(private_postgres: PrivatePostgres) -> Iterator[tuple[str, sa.Engine]]:
    name = f"outage_{uuid.uuid4().hex[:10]}"
    url = private_postgres.create_database(name)
    engine = make_engine(url)
    migrate(engine)
    try:
        yield name, engine
    finally:
        engine.dispose()


def test_relay_sessions_terminated_and_server_restarted_lose_nothing(
    private_postgres: PrivatePostgres,
    private_database: tuple[str, sa.Engine],
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    name, engine = private_database
    terminations = size(2, 5)
    restarts = ["immediate"] if size(1, 2) == 1 else ["fast", "immediate"]
    downtime = seconds(2, 10)
    total = size(3_000, 30_000)
    rate = size(200, 600)
    keys = [f"key-{i:03d}" for i in range(size(50, 300))]
    topic = new_topic(4)

    relay_url = private_postgres.url(name, application_name="outbox-relay")
    relay = RelayProcess(
        relay_url,
        kafka_bootstrap,
        tmp_path,
        "relay",
        "--lease-seconds",
        "6",
        "--delivery-timeout-ms",
        "3000",
        "--batch-size",
        "200",
    )
    ready = ReadinessWatch(relay)
    collector = Collector(kafka_bootstrap, topic)
    clock = RecoveryClock(engine)
    writer = Writer(engine, topic, keys, total, rate=rate)

    def explain() -> str:
        try:
            summary = outbox_summary(engine)
        except sa.exc.DBAPIError as exc:
            summary = f"(database unavailable: {exc.orig})"
        return f"{summary}\n--- relay log tail:\n{relay.log()[-4000:]}"

    def resumes() -> None:
        before = delivered_count(engine)
        wait_until(
            lambda: delivered_count(engine) > before or writer.done(),
            120,
            what="deliveries after the outage",
            explain=explain,
        )

    try:
        relay.start()
        ready.start()
        wait_until(lambda: relay.get("/readyz")[0] == 200, 60, what="ready", explain=explain)
        writer.start()
        wait_until(lambda: delivered_count(engine) >= total // 10, 120, explain=explain)

        # 1. The relay's sessions ended under it, several times.
        for _ in range(terminations):
            wait_until(lambda: delivered_count(engine) > 0, 30)
            ended = private_postgres.terminate_sessions(name, application_name="outbox-relay")
            assert ended >= 1, "the relay had no session to end"
            clock.fault_ended()
            resumes()

        # 2. The server stopped (cleanly, or as in a crash) and started again.
        for mode in restarts:
            # A session terminated while a readiness check ran on it fails that
            # check, and the 503 is cached for a moment: start each restart from
            # a relay that the watch sees ready (also after the previous restart).
            mark = ready.wait_for(200, 10, explain)
            private_postgres.stop(mode)
            ready.wait_for(503, 60, explain)
            time.sleep(downtime)
            assert relay.alive(), explain()
            private_postgres.start()
            clock.fault_ended()
            ready.wait_for(200, 120, explain)
            resumes()
            assert ready.since(mark)[:3] == [200, 503, 200], ready.seen

        writer.join(600)
        wait_all_delivered(engine, size(120, 600), explain)
        recover = clock.worst()
        collector.catch_up(set(writer.committed), 120)
        errors = relay.metric("outbox_database_errors_total")
        assert relay.alive(), explain()
    finally:
        writer.stop()
        ready.stop()
        code = relay.stop()
        collector.close()
    assert code == 0, explain()
    assert errors is not None and errors > 0, "the relay never retried a database step"
    check_writer(engine, writer)

    result = audit(engine, collector.generations)
    result.assert_clean()
    assert result.enqueued >= total
    result.row(
        "database outage",
        recover,
        f"relay sessions terminated {terminations} times; server restarted {len(restarts)} "
        "time(s) "
        f"({', '.join(restarts)} stop, {downtime:.0f} s down); "
        f"{len(writer.failures)} writer transactions failed and were retried",
    )
