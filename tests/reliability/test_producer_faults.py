"""A producer's connection dies inside its transaction: an error, and nothing half written.

Each faulty transaction writes a business row and some events, then its own
backend is ended with ``pg_terminate_backend`` before the next enqueue or the
commit. The caller must get an error from that call, and nothing of the
transaction may remain: no event, no business row, no step in a key's
sequence counter (the next committed event of the key follows without a
gap), nothing in Kafka. Healthy transactions on the same keys go on around
them while a relay publishes.
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from outbox_kafka import Event, Outbox
from outbox_kafka.relay import Relay
from tests.relay_support import make_settings, outbox_summary, running_relay, scalar
from tests.reliability.harness import Collector, audit, wait_all_delivered
from tests.reliability.report import size


@pytest.fixture
def orders_table(engine: sa.Engine) -> sa.Table:
    metadata = sa.MetaData()
    table = sa.Table(
        "orders",
        metadata,
        sa.Column("id", sa.Text, primary_key=True),
        sa.Column("note", sa.Text, nullable=False),
    )
    metadata.create_all(engine)
    return table


def test_connection_killed_inside_the_producer_transaction_leaves_nothing(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    orders_table: sa.Table,
) -> None:
    rounds = size(30, 400)
    rng = random.Random(uuid.uuid4().int)
    topic = new_topic(3)
    keys = [f"key-{i}" for i in range(8)]
    registry = CollectorRegistry()
    outbox = Outbox(allow_unknown_types=True, registry=registry)
    producer = sa.create_engine(engine.url, pool_pre_ping=True, pool_size=2)
    admin = sa.create_engine(engine.url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool)
    committed: list[str] = []
    aborted: list[str] = []
    aborted_orders: list[str] = []
    errors: list[str] = []
    recover: list[float] = []

    def events(n: int) -> list[Event]:
        return [
            Event(type="chaos.p", key=rng.choice(keys), data={"n": rng.random()}, topic=topic)
            for _ in range(n)
        ]

    def kill(pid: int) -> None:
        with admin.connect() as conn:
            assert conn.execute(sa.text("SELECT pg_terminate_backend(:p)"), {"p": pid}).scalar()

    relay = Relay(make_settings(database_url, kafka_bootstrap, batch_size=100))
    collector = Collector(kafka_bootstrap, topic)
    try:
        with running_relay(relay) as thread:
            for n in range(rounds):
                # A healthy transaction on the same keys.
                with producer.begin() as conn:
                    committed += [str(i) for i in outbox.enqueue_many(conn, events(3))]
                # A faulty one: business row, events, then its own backend is ended.
                order_id = f"order-{n}"
                conn = producer.connect()
                try:
                    tx = conn.begin()
                    pid = conn.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
                    conn.execute(orders_table.insert().values(id=order_id, note="faulty"))
                    written = [str(i) for i in outbox.enqueue_many(conn, events(4))]
                    aborted += written
                    aborted_orders.append(order_id)
                    kill(pid)
                    killed_at = time.monotonic()
                    with pytest.raises(sa.exc.DBAPIError) as caught:
                        if n % 2:
                            outbox.enqueue(conn, type="chaos.p", key="late", data={}, topic=topic)
                        tx.commit()
                    errors.append(str(caught.value.orig))
                finally:
                    conn.invalidate()
                    conn.close()
                with producer.begin() as after:
                    committed += [str(i) for i in outbox.enqueue_many(after, events(1))]
                recover.append(time.monotonic() - killed_at)
            wait_all_delivered(engine, 120, lambda: outbox_summary(engine))
            collector.catch_up(set(committed), 120)
            assert thread.error is None
    finally:
        collector.close()
        producer.dispose()
        admin.dispose()

    # The caller saw the connection go, at the enqueue or at the commit.
    assert len(errors) == rounds
    assert all("terminat" in e or "closed" in e for e in errors), errors[:3]
    failed_enqueues = registry.get_sample_value(
        "outbox_enqueue_failures_total", {"reason": "database"}
    )
    assert failed_enqueues == rounds // 2
    # Nothing of a faulty transaction remains anywhere.
    with engine.connect() as conn:
        present = set(conn.execute(sa.text("SELECT CAST(event_id AS text) FROM outbox")).scalars())
        orders = set(conn.execute(sa.select(orders_table.c.id)).scalars())
        gaps = conn.execute(
            sa.text(
                "SELECT s.ordering_key, s.last_seq, count(o.*), min(o.seq), max(o.seq) "
                "FROM outbox_key_seq s LEFT JOIN outbox o USING (ordering_key) "
                "GROUP BY s.ordering_key, s.last_seq "
                "HAVING s.last_seq <> count(o.*) OR min(o.seq) <> 1 OR max(o.seq) <> s.last_seq"
            )
        ).all()
    assert present == set(committed)
    assert not present & set(aborted)
    assert not orders & set(aborted_orders)
    assert gaps == [], f"sequence counters moved for rolled-back events: {gaps}"
    assert scalar(engine, "SELECT count(*) FROM outbox_keys WHERE ordering_key = 'late'") == 0

    result = audit(engine, collector.generations)
    result.assert_clean()  # phantoms: no event of a faulty transaction reached Kafka
    result.row(
        "producer connection killed",
        max(recover),
        f"{rounds} transactions lost their backend before enqueue/commit "
        f"({len(aborted)} events): each raised, none half written",
    )
