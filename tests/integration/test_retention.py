"""Retention: old delivered and discarded events are purged in bounded batches."""

from __future__ import annotations

from collections.abc import Callable

import sqlalchemy as sa

from outbox_kafka import Event
from outbox_kafka.relay import Relay
from tests.relay_support import admit_arrivals, enqueue_bulk, make_settings, topic_outbox

AGE = sa.text(
    "UPDATE outbox SET status = :status, delivered_at = CASE WHEN :status = 'delivered' "
    "THEN now() - make_interval(days => :days) END, "
    "created_at = now() - make_interval(days => :days) WHERE event_id = ANY(CAST(:ids AS uuid[]))"
)
STATUSES = sa.text("SELECT status, count(*) FROM outbox GROUP BY status ORDER BY status")


def _age(engine: sa.Engine, ids: list[str], status: str, days: int) -> None:
    with engine.begin() as conn:
        conn.execute(AGE, {"status": status, "days": days, "ids": ids})


def test_purge_removes_only_events_past_retention(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(1)
    ids = enqueue_bulk(
        engine,
        topic_outbox(),
        [Event(type="t", key=f"k{i % 7}", topic=topic, data={"i": i}) for i in range(250)],
    )
    _age(engine, ids[0:100], "delivered", 8)  # past the 7-day default: purged
    _age(engine, ids[100:120], "delivered", 6)  # kept
    _age(engine, ids[120:150], "discarded", 91)  # past the 90-day default: purged
    _age(engine, ids[150:170], "discarded", 89)  # kept
    # The remaining 80 stay pending, however old.
    _age(engine, ids[170:250], "pending", 400)

    relay = Relay(make_settings(database_url, kafka_bootstrap, purge_batch=7))
    try:
        relay.purge_once()
    finally:
        relay.close()

    with engine.connect() as conn:
        counts = dict(conn.execute(STATUSES).all())
        left = set(conn.execute(sa.text("SELECT CAST(event_id AS text) FROM outbox")).scalars())
    assert counts == {"delivered": 20, "discarded": 20, "pending": 80}
    assert left == set(ids[100:120]) | set(ids[150:170]) | set(ids[170:250])
    purged = relay.metrics.purged.collect()[0].samples[0].value
    assert purged == 130


def test_retention_is_configurable(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(1)
    ids = enqueue_bulk(
        engine, topic_outbox(), [Event(type="t", key="k", topic=topic, data={}) for _ in range(10)]
    )
    _age(engine, ids[:5], "delivered", 2)
    _age(engine, ids[5:], "delivered", 0)
    relay = Relay(make_settings(database_url, kafka_bootstrap, retain_delivered_seconds=86400))
    try:
        relay.purge_once()
    finally:
        relay.close()
    with engine.connect() as conn:
        assert dict(conn.execute(STATUSES).all()) == {"delivered": 5}


def test_drain_goes_past_keys_whose_events_are_all_done(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Empty keys at the head of the queue leave it; the work behind them still drains."""
    topic = new_topic(2)
    ids = enqueue_bulk(
        engine,
        topic_outbox(),
        [Event(type="t", key=f"k{i:02d}", topic=topic, data={"i": i}) for i in range(20)],
    )
    admit_arrivals(engine)
    with engine.begin() as conn:
        # k00..k09: done behind the relay's back, but still queued, and first in line.
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'delivered', delivered_at = now() "
                "WHERE event_id = ANY(CAST(:ids AS uuid[]))"
            ),
            {"ids": ids[:10]},
        )
        conn.execute(
            sa.text(
                "UPDATE outbox_keys SET due_at = now() - CASE WHEN ordering_key < 'k10' "
                "THEN interval '2 minutes' ELSE interval '1 minute' END"
            )
        )
    relay = Relay(make_settings(database_url, kafka_bootstrap, batch_size=10))
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert report.delivered == 10
    assert report.keys_removed >= 10
    with engine.connect() as conn:
        assert dict(conn.execute(STATUSES).all()) == {"delivered": 20}
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_keys")).scalar_one() == 0


def _counters(engine: sa.Engine) -> dict[str, int]:
    with engine.connect() as conn:
        return dict(
            conn.execute(sa.text("SELECT ordering_key, last_seq FROM outbox_key_seq")).all()
        )


def test_keys_with_nothing_left_lose_their_counter_and_start_again_in_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """The purge deletes the counter of a key whose last event it removed, when
    nothing of the key is left to order: the counters table does not keep a row
    per key ever used. Kept: a key with a discarded event (a requeue could bring
    it back), with a pending one, and one a writer is enqueueing for right now
    (its counter held by an open transaction from a second connection)."""
    topic = new_topic(1)
    outbox = topic_outbox()
    keys = ("gone", "discarded", "pending", "writing")
    ids = enqueue_bulk(
        engine,
        outbox,
        [Event(type="t", key=k, topic=topic, data={"n": n}) for n in range(3) for k in keys],
    )
    by_key = {k: ids[i::4] for i, k in enumerate(keys)}
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        assert relay.drain().delivered == 12
        _age(engine, [*by_key["gone"], *by_key["writing"], *by_key["pending"][:2]], "delivered", 8)
        _age(engine, by_key["discarded"][:2], "delivered", 8)
        _age(engine, by_key["discarded"][2:], "discarded", 1)
        _age(engine, by_key["pending"][2:], "pending", 0)
        assert _counters(engine) == dict.fromkeys(keys, 3)

        writer = engine.connect()
        try:
            writer.begin()
            outbox.enqueue(writer, type="t", key="writing", data={"n": 3}, topic=topic)
            relay.purge_once()  # the writer holds the counter of "writing"
            writer.commit()
        finally:
            writer.close()
        assert _counters(engine) == {"discarded": 3, "pending": 3, "writing": 4}

        with engine.begin() as conn:
            back = outbox.enqueue(conn, type="t", key="gone", data={"n": 0}, topic=topic)
        assert _counters(engine)["gone"] == 1
        assert relay.drain().delivered == 2
    finally:
        relay.close()
    with engine.connect() as conn:
        seq = conn.execute(
            sa.text("SELECT seq FROM outbox WHERE event_id = :id"), {"id": str(back)}
        ).scalar_one()
    assert seq == 1
