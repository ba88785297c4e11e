"""Exactly once across crashes: a relay that takes over keys whose claim ended without a
record reads Kafka back from the dead session's floors before it sends, records what
it finds there as delivered, and sends only the rest (docs/explanation/guarantees.md).

A relay "dies" here between its send and its record: its store raises instead of
recording, deterministically, and the relay is abandoned as a crash would leave it.
"""

from __future__ import annotations

import collections
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_kafka import Outbox
from outbox_kafka.naming import TableNames
from outbox_kafka.relay import Relay
from outbox_kafka.relay.batch import Doubts, EventOutcome, KeyOutcome, RecordResult
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.store import Store
from outbox_kafka.schema.migrations import migrate
from tests.relay_support import (
    Record,
    consume_all,
    make_settings,
    rows,
    scalar,
    topic_outbox,
)


class Crash(Exception):
    """The relay process ends here."""


class StoreThatDiesBeforeRecording(Store):
    """The relay's real store, except that the process dies instead of recording."""

    def record(
        self,
        token: uuid.UUID,
        keys: Sequence[KeyOutcome],
        events: Sequence[EventOutcome],
        doubts: Doubts | None = None,
    ) -> RecordResult:
        raise Crash


def settings(database_url: str, bootstrap: str, **overrides: Any) -> RelaySettings:
    # A short lease, the heir takes the keys over within seconds, with room for a
    # read-back before the send: the lease less one delivery timeout.
    values: dict[str, Any] = {"lease_seconds": 4.0, "delivery_timeout_ms": 1500}
    values.update(overrides)
    return make_settings(database_url, bootstrap, **values)


def enqueue(engine: sa.Engine, outbox: Outbox, topic: str, keys: int, per_key: int) -> list[str]:
    ids = []
    with engine.begin() as conn:
        for n in range(per_key):
            for k in range(keys):
                ids.append(
                    str(
                        outbox.enqueue(
                            conn, type="t.e", key=f"k{k}", data={"n": n, "k": k}, topic=topic
                        )
                    )
                )
    return ids


def crash_after_send(relay_settings: RelaySettings) -> None:
    """A relay that claims and sends one batch, then dies before recording it."""
    dying = Relay(
        relay_settings,
        store=StoreThatDiesBeforeRecording(relay_settings.database_url, relay_settings.names),
    )
    with pytest.raises(Crash):
        dying.cycle()
    dying.abandon()


def heir_drains(relay_settings: RelaySettings) -> Relay:
    """A relay that takes the dead one's keys over and publishes everything (closed)."""
    heir = Relay(relay_settings)
    try:
        result = heir.drain_all(timeout=30)
    finally:
        heir.close()
    assert result.complete, result.summary()
    return heir


def sample(relay: Relay, name: str) -> float:
    value = relay.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def copies_by_id(records: Sequence[Record]) -> collections.Counter[str]:
    return collections.Counter(r.event_id for r in records)


def test_the_heir_of_a_relay_killed_after_its_send_sends_nothing_twice(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=3)
    ids = enqueue(engine, topic_outbox(), topic, keys=20, per_key=3)
    relay_settings = settings(database_url, kafka_bootstrap)
    crash_after_send(relay_settings)
    # Every event reached Kafka; none is recorded.
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == len(ids)
    heir = Relay(relay_settings)
    try:
        result = heir.drain_all(timeout=30)
    finally:
        heir.close()
    assert result.complete, result.summary()
    records = consume_all(kafka_bootstrap, topic, expected=len(ids))
    copies = copies_by_id(records)
    assert set(copies) == set(ids)
    assert [i for i, n in copies.items() if n > 1] == []
    assert sample(heir, "outbox_read_back_matched_total") == len(ids)
    assert sample(heir, "outbox_read_backs_total") >= 1
    # Recorded where Kafka has them.
    where = {(r.event_id): (r.partition, r.offset) for r in records}
    stored = rows(
        engine, "SELECT CAST(event_id AS text), kafka_partition, kafka_offset FROM outbox"
    )
    assert {e: (p, o) for e, p, o in stored} == where
    # The doubt is settled: no key names the dead session any more.
    assert scalar(engine, "SELECT count(*) FROM outbox_keys WHERE doubt_sessions IS NOT NULL") == 0


def test_a_claim_that_died_before_its_send_is_read_back_and_sent_once(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    ids = enqueue(engine, topic_outbox(), topic, keys=5, per_key=2)
    relay_settings = settings(database_url, kafka_bootstrap)
    store = Store(relay_settings.database_url, relay_settings.names)
    try:
        # Claimed under a session that never produced anything, and never recorded.
        store.claim(batch_size=100, lease_seconds=4.0, session=uuid.uuid4())
    finally:
        store.close()
    heir = heir_drains(relay_settings)
    copies = copies_by_id(consume_all(kafka_bootstrap, topic, expected=len(ids)))
    assert set(copies) == set(ids) and max(copies.values()) == 1
    assert sample(heir, "outbox_read_back_matched_total") == 0


def test_events_written_after_the_crash_are_sent_after_those_found_on_kafka(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=1)
    outbox = topic_outbox()
    first = enqueue(engine, outbox, topic, keys=3, per_key=2)
    relay_settings = settings(database_url, kafka_bootstrap)
    crash_after_send(relay_settings)
    later = enqueue(engine, outbox, topic, keys=3, per_key=2)
    heir_drains(relay_settings)
    records = consume_all(kafka_bootstrap, topic, expected=len(first) + len(later))
    assert [r.event_id for r in records if r.event_id in first] == first_by_key_order(
        records, first
    )
    copies = copies_by_id(records)
    assert max(copies.values()) == 1 and set(copies) == set(first) | set(later)
    per_key: dict[str, list[int]] = collections.defaultdict(list)
    for r in records:
        per_key[r.key or ""].append(r.value["data"]["n"] if r.event_id in later else -1)
    for key, order in per_key.items():
        # The first two (found on Kafka) come before the two written later, in order.
        assert order == [-1, -1, 0, 1], (key, order)


def first_by_key_order(records: Sequence[Record], ids: Sequence[str]) -> list[str]:
    wanted = set(ids)
    return [r.event_id for r in records if r.event_id in wanted]


def test_a_floor_above_the_end_leaves_the_key_unsent_and_counted_until_an_operator_chooses(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=1)
    ids = enqueue(engine, topic_outbox(), topic, keys=2, per_key=1)
    relay_settings = settings(database_url, kafka_bootstrap)
    crash_after_send(relay_settings)
    # As if the broker had been restarted empty: the floor lies past the log's end.
    with engine.begin() as conn:
        conn.exec_driver_sql("UPDATE outbox_floors SET floor_offset = floor_offset + 1000000")
    heir = Relay(relay_settings)
    try:
        started = time.monotonic()
        result = heir.drain_all(timeout=8)
        # It waited for the dead relay's lease, read until its deadline, and gave up.
        assert time.monotonic() - started < 15
        assert result.report.delivered == 0 and not result.complete
        assert sample(heir, "outbox_read_back_unproven_total") >= 1
        assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == len(ids)
    finally:
        heir.close()
    # An operator who prefers at least once to waiting lets the relay send them.
    sending = Relay(settings(database_url, kafka_bootstrap, on_unproven="send"))
    try:
        assert sending.drain_all(timeout=30).complete
        assert sample(sending, "outbox_read_back_sent_unproven_total") >= 1
    finally:
        sending.close()


@pytest.mark.parametrize("mode", ["binary", "id_header"])
def test_binary_mode_and_an_id_header_are_read_back_too(
    mode: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic(partitions=2)
    outbox = (
        topic_outbox(content_mode="binary")
        if mode == "binary"
        else topic_outbox(id_header="message-id")
    )
    ids = enqueue(engine, outbox, topic, keys=6, per_key=2)
    relay_settings = settings(database_url, kafka_bootstrap)
    crash_after_send(relay_settings)
    heir = heir_drains(relay_settings)
    copies = copies_by_id(consume_all(kafka_bootstrap, topic, expected=len(ids)))
    assert set(copies) == set(ids) and max(copies.values()) == 1
    assert sample(heir, "outbox_read_back_matched_total") == len(ids)


def test_two_outboxes_on_one_topic_with_the_same_supplied_ids_are_told_apart(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    migrate(engine, TableNames(table="second"))
    shared = [uuid.uuid4() for _ in range(6)]
    first, second = topic_outbox(), topic_outbox(table="second")
    with engine.begin() as conn:
        for n, event_id in enumerate(shared):
            for outbox, data in ((first, {"from": "first"}), (second, {"from": "second"})):
                outbox.enqueue(
                    conn,
                    type="t.e",
                    key=f"k{n % 2}",
                    data={**data, "n": n},
                    topic=topic,
                    event_id=event_id,
                )
    for table in ("outbox", "second"):
        crash_after_send(settings(database_url, kafka_bootstrap, table=table))
    heirs = [
        Relay(settings(database_url, kafka_bootstrap, table=table))
        for table in ("outbox", "second")
    ]
    try:
        for heir in heirs:
            assert heir.drain_all(timeout=30).complete
    finally:
        for heir in heirs:
            heir.close()
    records = consume_all(kafka_bootstrap, topic, expected=len(shared))
    assert len(records) == 2 * len(shared)
    seen = collections.Counter((r.event_id, r.value["data"]["from"]) for r in records)
    assert set(seen.values()) == {1} and len(seen) == 2 * len(shared)
    assert [sample(h, "outbox_read_back_matched_total") for h in heirs] == [6, 6]


def test_a_dead_letter_copy_sent_before_a_crash_is_not_made_again(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic, dlt = new_topic(partitions=2), new_topic(partitions=2, prefix="dlt")
    ids = enqueue(engine, topic_outbox(), topic, keys=4, per_key=2)
    # The first event of k0 cannot be sent: it is discarded with a dead-letter copy.
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "UPDATE outbox SET value = 'not json'::bytea WHERE event_id = %(id)s", {"id": ids[0]}
        )
    relay_settings = settings(database_url, kafka_bootstrap, dead_letter_topic=dlt)
    crash_after_send(relay_settings)
    heir_drains(relay_settings)
    [copy] = consume_all(kafka_bootstrap, dlt, expected=1)
    assert copy.event_id == ids[0]
    copies = copies_by_id(consume_all(kafka_bootstrap, topic, expected=len(ids) - 1))
    assert set(copies) == set(ids[1:]) and max(copies.values()) == 1
    assert scalar(engine, "SELECT status FROM outbox WHERE event_id = :id", id=ids[0]) == (
        "discarded"
    )


def test_keys_on_a_compacted_topic_are_sent_again_whole_in_order_and_counted(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    # Compaction deletes a key's older messages once a newer one is there, so what
    # such a topic lacks proves nothing: the heir sends the dead relay's keys again
    # whole, in order (at least once), and counts them.
    topic = new_topic(partitions=2, config={"cleanup.policy": "compact"})
    ids = enqueue(engine, topic_outbox(), topic, keys=5, per_key=2)
    relay_settings = settings(database_url, kafka_bootstrap)
    crash_after_send(relay_settings)
    heir = heir_drains(relay_settings)
    records = consume_all(kafka_bootstrap, topic, expected=2 * len(ids))
    assert copies_by_id(records) == {i: 2 for i in ids}
    by_key: dict[str, list[str]] = collections.defaultdict(list)
    for r in records:
        by_key[r.key or ""].append(r.event_id)
    for key, sent in by_key.items():
        mine = [i for i in ids if i in set(sent)]
        assert sent == mine + mine, key  # the dead relay's send, then the heir's
    assert sample(heir, "outbox_read_back_compacted_total") == 5
    assert sample(heir, "outbox_read_back_matched_total") == 0
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'delivered'") == len(ids)
