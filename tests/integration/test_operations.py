"""The operator actions (``outbox_kafka.operations``) on a real PostgreSQL and a real broker.

Outboxes are brought into their states by the producer and the relay; what
Kafka finally holds is read back with a plain consumer.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa

from outbox_kafka import Event
from outbox_kafka.errors import ConfigurationError, InvalidSelection
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import (
    Selection,
    outbox_stats,
    pending_topics,
    purge,
    remaining_work,
    requeue,
    requeue_events,
    unpark,
    unpark_keys,
)
from outbox_kafka.relay.batch import CycleReport, DrainResult, EventOutcome, KeyOutcome
from outbox_kafka.relay.store import Store
from outbox_kafka.schema.statements import queries_for
from tests.operator_support import (
    build_mix,
    corrupt,
    counts_by_topic,
    drain,
    restore,
    snapshot,
)
from tests.relay_support import (
    consume_all,
    enqueue_bulk,
    per_key_order,
    rows,
    scalar,
    topic_outbox,
)

# --------------------------------------------------------------------------- stats


def test_stats_match_the_table(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    mix = build_mix(engine, database_url, kafka_bootstrap, new_topic)
    age_before = float(
        scalar(
            engine,
            "SELECT EXTRACT(EPOCH FROM now() - min(created_at)) FROM outbox "
            "WHERE status = 'pending'",
        )
    )
    stats = outbox_stats(engine, parked_limit=5, discard_limit=5)
    age_after = float(
        scalar(
            engine,
            "SELECT EXTRACT(EPOCH FROM now() - min(created_at)) FROM outbox "
            "WHERE status = 'pending'",
        )
    )

    truth = counts_by_topic(engine)
    assert {t.topic: (t.pending, t.delivered, t.discarded) for t in stats.topics} == {
        topic: (s.get("pending", 0), s.get("delivered", 0), s.get("discarded", 0))
        for topic, s in truth.items()
    }
    # The mix itself, so the comparison above is not between two empty tables.
    assert truth == {
        mix.busy: {"delivered": 8, "discarded": 1, "pending": 5},
        mix.parked: {"delivered": 1, "discarded": 1, "pending": 4},
    }
    assert (stats.totals.pending, stats.totals.delivered, stats.totals.discarded) == (9, 9, 2)
    assert stats.oldest_pending_age_seconds is not None
    assert age_before <= stats.oldest_pending_age_seconds <= age_after
    # Keys in the relay's queue and keys producers queued that it has not taken in yet.
    assert stats.keys_queued == scalar(
        engine,
        "SELECT count(*) FROM (SELECT ordering_key FROM outbox_keys "
        "UNION SELECT ordering_key FROM outbox_arrivals) q",
    )
    assert stats.keys_leased == 0

    assert stats.parked_count == 1
    [parked] = stats.parked_keys
    error = scalar(
        engine, "SELECT last_error FROM outbox WHERE event_id = :id", id=mix.parking_event
    )
    assert (parked.key, parked.reason) == ("P", error)
    assert parked.event is not None and parked.event.event_id == mix.parking_event
    assert parked.next_seq == 2
    assert "INVALID_ENVELOPE" in error

    expected = rows(
        engine,
        "SELECT CAST(event_id AS text), last_error FROM outbox WHERE status = 'discarded' "
        "ORDER BY created_at DESC",
    )
    assert [(e.event_id, e.last_error) for e in stats.recent_discards] == [
        tuple(r) for r in expected
    ]
    assert {e.event_id for e in stats.recent_discards} == {mix.continue_discard, mix.parking_event}

    without = outbox_stats(engine, count_delivered=False, parked_limit=0, discard_limit=1)
    assert all(t.delivered is None for t in without.topics)
    assert without.as_dict()["totals"] == {"pending": 9, "delivered": None, "discarded": 2}
    assert (without.parked_count, without.parked_keys) == (1, [])
    assert [e.event_id for e in without.recent_discards] == [expected[0][0]]


def test_stats_of_an_empty_outbox(engine: sa.Engine) -> None:
    stats = outbox_stats(engine)
    assert stats.topics == []
    assert stats.oldest_pending_age_seconds is None
    assert (stats.parked_count, stats.parked_keys, stats.recent_discards) == (0, [], [])
    assert stats.as_dict()["totals"] == {"pending": 0, "delivered": 0, "discarded": 0}


# --------------------------------------------------------------------------- requeue


def test_requeue_of_a_parked_key_sends_it_first_and_in_sequence_order(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    mix = build_mix(engine, database_url, kafka_bootstrap, new_topic)
    restore(engine, mix.parking_event, mix.parking_value)
    before = snapshot(engine)

    planned = requeue(engine, Selection(keys=("P",)), dry_run=True)
    assert [e.event_id for e in planned.events] == [mix.parking_event]
    assert planned.unparked_keys == ["P"]
    assert snapshot(engine) == before, "a dry run changed the outbox"

    done = requeue(engine, Selection(keys=("P",)))
    assert (done.count, done.unparked_keys, done.dry_run) == (1, ["P"], False)
    assert scalar(
        engine, "SELECT status FROM outbox WHERE event_id = :id", id=mix.parking_event
    ) == ("pending")
    assert scalar(engine, "SELECT parked_at FROM outbox_keys WHERE ordering_key = 'P'") is None

    report = drain(database_url, kafka_bootstrap, on_exhausted="park")
    assert (report.delivered, report.discarded) == (10, 0)
    records = consume_all(kafka_bootstrap, mix.parked, 6)
    assert per_key_order(records) == {"P": mix.ids["P"]}
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 1  # C's


def test_requeued_events_go_out_before_later_pending_events_of_their_key(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Key K continued past two discards; requeued, they go in order, ahead of K's new events."""
    topic = new_topic(2)
    outbox = topic_outbox()
    first = enqueue_bulk(
        engine, outbox, [Event(type="t.e", key="K", topic=topic, data={"n": n}) for n in range(5)]
    )
    originals = {first[1]: corrupt(engine, first[1]), first[3]: corrupt(engine, first[3])}
    report = drain(database_url, kafka_bootstrap)
    assert (report.delivered, report.discarded) == (3, 2)
    later = enqueue_bulk(
        engine, outbox, [Event(type="t.e", key="K", topic=topic, data={"n": n}) for n in (5, 6)]
    )
    for event_id, value in originals.items():
        restore(engine, event_id, value)

    assert requeue_events(engine, [first[3], uuid.UUID(first[1])]) == 2
    assert requeue_events(engine, [first[1]]) == 0  # no longer discarded
    assert scalar(engine, "SELECT next_seq FROM outbox_keys WHERE ordering_key = 'K'") == 2

    report = drain(database_url, kafka_bootstrap)
    assert (report.delivered, report.discarded) == (4, 0)
    records = consume_all(kafka_bootstrap, topic, 7)
    assert per_key_order(records) == {
        "K": [first[0], first[2], first[4], first[1], first[3], *later]
    }


def test_selectors_choose_exactly_the_matching_discarded_events(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topics = [new_topic(1), new_topic(1)]
    events = [
        Event(
            type=("a.made", "b.made")[i % 2],
            key=f"k{i % 3}",
            topic=topics[i % 4 // 2],
            data={"i": i},
        )
        for i in range(24)
    ]
    ids = enqueue_bulk(engine, topic_outbox(), events)
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox SET value = 'not json'::bytea"))
    discarded = 0
    for _ in range(24):  # a drain ends after a cycle that only discarded: run it again
        discarded += drain(database_url, kafka_bootstrap).discarded
        if discarded == 24:
            break
    assert discarded == 24
    # Spread creation times over 24 days, event i written i days ago.
    now = datetime.now(UTC).replace(microsecond=0)
    with engine.begin() as conn:
        for i, event_id in enumerate(ids):
            conn.execute(
                sa.text("UPDATE outbox SET created_at = :t WHERE event_id = :id"),
                {"t": now - timedelta(days=i), "id": event_id},
            )
    truth = rows(
        engine,
        "SELECT CAST(event_id AS text) AS id, ordering_key, seq, type, topic, created_at "
        "FROM outbox ORDER BY ordering_key, seq",
    )

    def expected(keep: Callable[[sa.Row[tuple[object, ...]]], bool]) -> list[str]:
        return [r.id for r in truth if keep(r)]

    since, until = now - timedelta(days=10), now - timedelta(days=3)
    cases: list[tuple[Selection, list[str]]] = [
        (Selection(keys=("k1",)), expected(lambda r: r.ordering_key == "k1")),
        (Selection(keys=("k0", "k2")), expected(lambda r: r.ordering_key in ("k0", "k2"))),
        (Selection(types=("b.made",)), expected(lambda r: r.type == "b.made")),
        (Selection(topics=(topics[1],)), expected(lambda r: r.topic == topics[1])),
        (Selection(since=since), expected(lambda r: r.created_at >= since)),
        (Selection(until=until), expected(lambda r: r.created_at < until)),
        (
            Selection(since=since, until=until, types=("a.made",), keys=("k0", "k1")),
            expected(
                lambda r: (
                    since <= r.created_at < until
                    and r.type == "a.made"
                    and r.ordering_key in ("k0", "k1")
                )
            ),
        ),
        (Selection(event_ids=(ids[7], ids[4])), expected(lambda r: r.id in (ids[4], ids[7]))),
        (Selection(everything=True), [r.id for r in truth]),
        (Selection(keys=("nobody",)), []),
    ]
    for selection, wanted in cases:
        assert wanted or selection.keys == ("nobody",), selection
        planned = requeue(engine, selection, dry_run=True)
        assert [e.event_id for e in planned.events] == wanted, selection
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'discarded'") == 24

    chosen = Selection(types=("b.made",), since=since)
    wanted = set(expected(lambda r: r.type == "b.made" and r.created_at >= since))
    assert requeue(engine, chosen).count == len(wanted)
    pending = rows(engine, "SELECT CAST(event_id AS text) FROM outbox WHERE status = 'pending'")
    assert {r[0] for r in pending} == wanted


def test_an_empty_selection_is_refused(engine: sa.Engine) -> None:
    with pytest.raises(InvalidSelection, match="nothing selected"):
        requeue(engine, Selection())
    with pytest.raises(InvalidSelection, match="nothing selected"):
        unpark(engine, Selection(), dry_run=True)
    with pytest.raises(InvalidSelection, match="cannot be combined"):
        Selection(everything=True, keys=("a",))
    with pytest.raises(InvalidSelection, match="not a UUID"):
        Selection(event_ids=("42",))
    with pytest.raises(InvalidSelection, match="no time zone"):
        Selection(since=datetime(2030, 1, 1))
    with pytest.raises(InvalidSelection, match="empty time range"):
        Selection(since=datetime(2030, 1, 2, tzinfo=UTC), until=datetime(2030, 1, 1, tzinfo=UTC))
    assert requeue_events(engine, []) == 0 and unpark_keys(engine, []) == 0


def test_events_of_a_parked_key_are_requeued_only_with_the_event_that_parked_it(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(1)
    outbox = topic_outbox()

    def write(n: int) -> list[str]:
        return enqueue_bulk(
            engine,
            outbox,
            [Event(type="t.e", key="P", topic=topic, data={"n": i}) for i in range(n)],
        )

    first = write(2)
    old_value = corrupt(engine, first[0])
    drain(database_url, kafka_bootstrap)  # continue: first[0] discarded, first[1] delivered
    second = write(3)
    park_value = corrupt(engine, second[0])
    drain(database_url, kafka_bootstrap, on_exhausted="park")
    assert scalar(engine, "SELECT next_seq FROM outbox_keys WHERE parked_at IS NOT NULL") == 3
    before = snapshot(engine)

    with pytest.raises(InvalidSelection) as refused:
        requeue(engine, Selection(event_ids=(first[0],)))
    assert "'P'" in str(refused.value) and second[0] in str(refused.value)
    assert "outbox-kafka unpark" in str(refused.value)
    assert snapshot(engine) == before

    restore(engine, first[0], old_value)
    restore(engine, second[0], park_value)
    result = requeue(engine, Selection(keys=("P",)))
    assert [e.event_id for e in result.events] == [first[0], second[0]]
    assert result.unparked_keys == ["P"]
    report = drain(database_url, kafka_bootstrap, on_exhausted="park")
    assert (report.delivered, report.discarded) == (4, 0)
    records = consume_all(kafka_bootstrap, topic, 5)
    # first[0] comes after first[1], which Kafka already had; the rest in sequence order.
    assert per_key_order(records) == {"P": [first[1], first[0], *second]}


def test_requeue_takes_the_key_back_from_a_relay_holding_it(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A relay's finish must not move the key past events requeued while it was sending."""
    topic = new_topic(1)
    outbox = topic_outbox()
    [poison] = enqueue_bulk(engine, outbox, [Event(type="t.e", key="K", topic=topic, data={})])
    value = corrupt(engine, poison)
    drain(database_url, kafka_bootstrap)
    later = enqueue_bulk(
        engine, outbox, [Event(type="t.e", key="K", topic=topic, data={"n": n}) for n in range(3)]
    )
    restore(engine, poison, value)

    store = Store(database_url, TableNames())
    try:
        claim = store.claim(batch_size=10, lease_seconds=30)
        [claimed] = claim.keys
        assert [e.event_id for e in claimed.events] == later

        result = requeue(engine, Selection(event_ids=(poison,)))
        assert (result.count, result.taken_keys) == (1, ["K"])

        # The holder reports its batch as delivered: fenced out, nothing recorded.
        outcome = store.record(
            claim.token,
            [KeyOutcome("K", claimed.events[-1].seq + 1, 0.0, False, True)],
            [
                EventOutcome(e.event_id, "K", "delivered", 0, 0.0, 0, n, None)
                for n, e in enumerate(claimed.events)
            ],
        )
    finally:
        store.close()
    assert outcome.keys_owned == 0
    assert scalar(engine, "SELECT next_seq FROM outbox_keys WHERE ordering_key = 'K'") == 1
    # Nobody takes the key before the holder's lease has ended; here it ends now.
    assert drain(database_url, kafka_bootstrap).delivered == 0
    with engine.begin() as conn:
        conn.execute(sa.text("UPDATE outbox_keys SET due_at = now()"))
    report = drain(database_url, kafka_bootstrap)
    assert (report.delivered, report.discarded) == (4, 0)
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 0
    assert per_key_order(consume_all(kafka_bootstrap, topic, 4)) == {"K": [poison, *later]}


# --------------------------------------------------------------------------- unpark


def test_unpark_lets_the_key_continue_without_the_event_that_parked_it(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    mix = build_mix(engine, database_url, kafka_bootstrap, new_topic)
    before = snapshot(engine)
    assert unpark(engine, Selection(types=("t.e",))).count == 0  # P was parked by a p.e event
    planned = unpark(engine, Selection(types=("p.e",)), dry_run=True)
    assert [(k.key, k.event.event_id if k.event else None) for k in planned.keys] == [
        ("P", mix.parking_event)
    ]
    assert snapshot(engine) == before

    assert unpark(engine, Selection(everything=True)).count == 1
    assert unpark_keys(engine, ["P"]) == 0  # no longer parked
    report = drain(database_url, kafka_bootstrap, on_exhausted="park")
    assert (report.delivered, report.discarded) == (9, 0)
    records = consume_all(kafka_bootstrap, mix.parked, 5)
    assert per_key_order(records) == {"P": [i for i in mix.ids["P"] if i != mix.parking_event]}
    assert scalar(
        engine, "SELECT status FROM outbox WHERE event_id = :id", id=mix.parking_event
    ) == ("discarded")


# --------------------------------------------------------------------------- purge

AGE = sa.text(
    "UPDATE outbox SET status = :status, delivered_at = CASE WHEN :status = 'delivered' "
    "THEN now() - make_interval(days => :days) END, "
    "created_at = now() - make_interval(days => :days) WHERE event_id = ANY(CAST(:ids AS uuid[]))"
)


def test_purge_removes_old_delivered_and_discarded_events_only(engine: sa.Engine) -> None:
    ids = enqueue_bulk(
        engine,
        topic_outbox(),
        [Event(type="t", key=f"k{i % 5}", topic="t", data={"i": i}) for i in range(100)],
    )
    with engine.begin() as conn:
        for status, days, chunk in [
            ("delivered", 8, ids[0:30]),  # past the 7-day default
            ("delivered", 6, ids[30:40]),
            ("discarded", 91, ids[40:60]),  # past the 90-day default
            ("discarded", 30, ids[60:70]),
            ("pending", 400, ids[70:100]),  # never purged
        ]:
            conn.execute(AGE, {"status": status, "days": days, "ids": chunk})
    before = snapshot(engine)

    counted = purge(engine, dry_run=True)
    assert (counted.delivered, counted.discarded, counted.dry_run) == (30, 20, True)
    assert snapshot(engine) == before

    done = purge(engine, batch=7)
    assert (done.delivered, done.discarded) == (30, 20)
    left = {r[0] for r in rows(engine, "SELECT CAST(event_id AS text) FROM outbox")}
    assert left == set(ids[30:40]) | set(ids[60:100])

    shorter = purge(engine, retain_delivered_seconds=5 * 86400, retain_discarded_seconds=29 * 86400)
    assert (shorter.delivered, shorter.discarded) == (10, 10)
    assert {r[0] for r in rows(engine, "SELECT CAST(event_id AS text) FROM outbox")} == set(
        ids[70:100]
    )
    with pytest.raises(ConfigurationError, match="must not be negative"):
        purge(engine, retain_delivered_seconds=-1)


# --------------------------------------------------------------------------- check, drain


def test_pending_topics_reads_at_most_its_bound_through_the_claim_index(
    engine: sa.Engine,
) -> None:
    outbox = topic_outbox()
    enqueue_bulk(
        engine,
        outbox,
        [Event(type="t", key=f"k{i % 40}", topic=f"t{i % 3}", data={"i": i}) for i in range(3000)],
    )
    with engine.begin() as conn:
        conn.exec_driver_sql("ANALYZE outbox")
    whole = pending_topics(engine, TableNames())
    assert whole.complete and whole.read == 3000 and not whole.more_topics
    assert whole.counts == {"t0": 1000, "t1": 1000, "t2": 1000}

    part = pending_topics(engine, TableNames(), scan_limit=100, topic_limit=2)
    assert (part.read, part.complete, part.more_topics) == (100, False, True)
    assert len(part.counts) == 2 and sum(part.counts.values()) <= 100

    with engine.connect() as conn:
        plan = conn.execute(
            sa.text(
                "EXPLAIN (ANALYZE, FORMAT JSON) " + queries_for(TableNames()).sql["pending_topics"]
            ),
            {"scan_limit": 100, "topic_limit": 50},
        ).scalar_one()[0]["Plan"]
    stack = [plan]
    while stack:
        node = stack.pop()
        stack.extend(node.get("Plans", []))
        if node.get("Relation Name") == "outbox":
            assert node.get("Index Name") == "outbox_claim_idx", node
            assert node["Actual Rows"] * node["Actual Loops"] <= 100, node


def test_remaining_work_names_held_events_apart_from_delayed_ones(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    missing = f"missing-{uuid.uuid4().hex[:12]}"
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, [Event(type="t", key=k, topic=missing, data={}) for k in "aab"])
    drain(database_url, kafka_bootstrap, backoff_cap=30.0)

    left = remaining_work(engine)
    assert (left.pending, left.held, left.delayed, left.retrying) == (3, 3, 3, 0)
    assert left.held_reason_count == 1
    [reason] = left.held_reasons
    assert reason.startswith(f"UNKNOWN_TOPIC: topic '{missing}' does not exist")
    summary = DrainResult(CycleReport(), left).summary()
    assert f"left pending: 3 (3 held: {reason})" in summary
    assert "delayed" not in summary

    # A key waiting for an event's available_at is delayed, not held.
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox_keys SET due_at = now() + interval '1 hour' WHERE ordering_key = 'b'"
        )
        conn.exec_driver_sql("UPDATE outbox SET last_error = NULL WHERE ordering_key = 'b'")
    left = remaining_work(engine)
    assert (left.pending, left.held, left.delayed) == (3, 2, 3)
    assert "2 held: UNKNOWN_TOPIC" in DrainResult(CycleReport(), left).summary()
    assert "1 delayed (available_at)" in DrainResult(CycleReport(), left).summary()
