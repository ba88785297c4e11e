"""The recovery step (relay/recover.py, ``Recovery``) on the in-memory fakes: sessions
and their floors, keys in doubt, and the read-back before a key in doubt is sent again."""

from __future__ import annotations

import threading
import uuid
from typing import Any

from outbox_kafka.errors import StorageError
from outbox_kafka.relay import Relay
from outbox_kafka.relay.batch import EventStatus, Floor, Verdict
from outbox_kafka.relay.ports import Message
from outbox_kafka.relay.recover import ReadBackError, key_partition
from outbox_kafka.testing import InMemoryStore, StubPublisher, StubReader
from tests.fakes_support import NO_DATABASE, enqueue
from tests.relay_support import make_settings


class Clock:
    """The store's clock, moved on by the test."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def relay(
    store: InMemoryStore, publisher: StubPublisher, reader: StubReader | None = None, **over: Any
) -> Relay:
    return Relay(
        make_settings(NO_DATABASE, "unused:1", **over),
        store=store,
        publisher=publisher,
        reader=reader or publisher.reader(),
    )


def sample(r: Relay, name: str) -> float:
    value = r.metrics.registry.get_sample_value(name)
    return 0.0 if value is None else value


def on_log(publisher: StubPublisher) -> list[str]:
    """The event ids on the publisher's log, in the order they landed."""
    return [m.event_id for log in publisher.log.values() for m in log]


def test_an_outcome_that_may_have_landed_puts_the_key_in_doubt_and_the_heir_records_it() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 2)
    # The first event lands without a report (a timeout, a connection lost).
    publisher = StubPublisher(
        lambda m: Verdict.UNREPORTED if m.event_id == ids[0] else Verdict.DELIVERED
    )
    first = relay(store, publisher)
    session = first.recovery.session() if first.recovery else None
    first.cycle()
    assert store.doubt("a") == [str(session)]
    # The session's floors stay where they were: a message of it may be unrecorded.
    assert [f.offset for f in store.floors()] == [0]
    # Its next claims belong to another session.
    assert first.recovery is not None and first.recovery.session() != session
    # The key waits a lease for the message that may land; then it is read back.
    clock.now += 60
    publisher.answer = lambda m: Verdict.DELIVERED
    first.cycle()
    assert [e.status for e in store.events("a")] == ["delivered", "delivered"]
    assert on_log(publisher) == ids  # each once
    assert sample(first, "outbox_read_back_matched_total") == 1
    # Every event claimed was found: more of the session's may follow, until the
    # key has nothing left.
    first.cycle()
    assert store.doubt("a") == []


def test_a_refusal_the_broker_reported_leaves_no_doubt() -> None:
    store = InMemoryStore()
    enqueue(store, "a", 1)
    publisher = StubPublisher(lambda m: (Verdict.RETRIABLE, "NOT_ENOUGH_REPLICAS: refused"))
    r = relay(store, publisher)
    session = r.recovery.session() if r.recovery else None
    r.cycle()
    assert store.doubt("a") == []
    assert r.recovery is not None and r.recovery.session() == session


def dead_relay_sent(
    store: InMemoryStore, publisher: StubPublisher, clock: Clock, how_many: int
) -> str:
    """A relay claims the key "a", opens its floor on partition 0 of "t", sends its first
    ``how_many`` events and dies before its record; its lease then runs out. Returns
    its session."""
    dead = relay(store, publisher)
    assert dead.recovery is not None
    session = dead.recovery.session()
    claim = store.claim(batch_size=10, lease_seconds=5, session=session)
    store.open_floors(
        session, [Floor(str(session), "t", 0, 1, len(publisher.log.get(("t", 0), [])))]
    )
    events = claim.keys[0].events[:how_many]
    publisher.send(
        [Message("t", b"a", e.value, e.headers or [], e.event_id, 0) for e in events], timeout=1
    )
    clock.now += 10
    return str(session)


def test_a_claim_that_ends_without_a_record_leaves_its_session_in_doubt() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 3)
    publisher = StubPublisher()
    dead_relay_sent(store, publisher, clock, 2)
    heir = relay(store, publisher)
    heir.cycle()
    assert [e.status for e in store.events("a")] == ["delivered"] * 3
    assert on_log(publisher) == ids
    # The third was not found on Kafka: what the dead session sent ends there.
    assert store.doubt("a") == []
    assert sample(heir, "outbox_read_back_matched_total") == 2
    assert sample(heir, "outbox_read_back_absent_total") == 1


def test_when_every_event_claimed_is_found_the_doubt_stays_for_the_next_claim() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 4)
    publisher = StubPublisher()
    dead_relay_sent(store, publisher, clock, 4)
    heir = relay(store, publisher, batch_size=2)  # claims two of the four sent
    heir.cycle()
    assert [e.status for e in store.events("a")] == ["delivered"] * 2 + ["pending"] * 2
    assert store.doubt("a") != []  # two more of the dead session's may follow
    heir.cycle()
    assert [e.status for e in store.events("a")] == ["delivered"] * 4
    assert on_log(publisher) == ids
    assert sample(heir, "outbox_read_back_matched_total") == 4


def test_an_unproven_key_waits_unsent_or_is_sent_when_the_operator_prefers() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 1)
    publisher = StubPublisher()
    dead_relay_sent(store, publisher, clock, 0)
    blind = StubReader(publisher, unproven={("t", 0): "deadline reached"})
    waiting = relay(store, publisher, blind)
    waiting.cycle()
    assert on_log(publisher) == [] and store.doubt("a") != []
    assert sample(waiting, "outbox_read_back_unproven_total") == 1
    clock.now += 10
    sending = relay(
        store, publisher, StubReader(publisher, unproven=blind.unproven), on_unproven="send"
    )
    sending.cycle()
    assert on_log(publisher) == ids and store.doubt("a") == []
    assert sample(sending, "outbox_read_back_sent_unproven_total") == 1


def test_keys_on_a_compacted_topic_are_sent_again_whole_and_counted() -> None:
    # Compaction deletes a key's older messages once a newer one is there: what a
    # compacted topic lacks proves nothing, so the heir sends the key's events
    # again, in order, as an at-least-once relay would, and counts the key.
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 3)
    publisher = StubPublisher()
    dead_relay_sent(store, publisher, clock, 2)
    heir = relay(store, publisher, StubReader(publisher, compacted={"t"}))
    heir.cycle()
    assert [e.status for e in store.events("a")] == ["delivered"] * 3
    assert on_log(publisher) == ids[:2] + ids  # the two the dead relay sent, twice
    assert store.doubt("a") == []
    assert sample(heir, "outbox_read_back_compacted_total") == 1
    assert sample(heir, "outbox_read_back_matched_total") == 0


class UnansweredReader(StubReader):
    """A broker that does not answer about cleanup policies."""

    def compacted(self, topic: str, timeout: float) -> bool | None:
        raise ReadBackError(f"no answer about the cleanup policy of topic {topic!r}")


def test_a_cleanup_policy_not_answered_leaves_the_key_unsent_and_unproven() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    enqueue(store, "a", 1)
    publisher = StubPublisher()
    dead_relay_sent(store, publisher, clock, 0)
    heir = relay(store, publisher, UnansweredReader(publisher))
    heir.cycle()
    assert on_log(publisher) == [] and store.doubt("a") != []
    assert sample(heir, "outbox_read_back_unproven_total") == 1


def test_a_compacted_topic_elsewhere_leaves_other_keys_read_back() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 2)
    publisher = StubPublisher()
    dead_relay_sent(store, publisher, clock, 2)
    heir = relay(store, publisher, StubReader(publisher, compacted={"another-topic"}))
    heir.cycle()
    assert on_log(publisher) == ids
    assert sample(heir, "outbox_read_back_compacted_total") == 0
    assert sample(heir, "outbox_read_back_matched_total") == 2


def test_floors_open_before_the_first_send_and_rise_with_each_clean_record() -> None:
    store = InMemoryStore()
    enqueue(store, "a", 2)
    enqueue(store, "b", 1)
    publisher = StubPublisher(partitions={"t": 3})
    r = relay(store, publisher)
    r.cycle()
    floors = store.floors()
    assert {(f.topic, f.partition, f.partitions) for f in floors} == {
        ("t", p, 3) for p in {m.partition for m in publisher.sends[0]}
    }
    assert all(m.partition is not None for m in publisher.sends[0])
    ends = {(t, p): len(log) for (t, p), log in publisher.log.items()}
    assert {(f.topic, f.partition): f.offset for f in store.floors()} == ends


def test_a_lost_lease_keeps_the_sessions_floors_where_they_were() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 1)
    heir_claim = []

    def take_over(message: Message) -> Verdict:
        # The lease ends while the message is in flight, and another relay claims the key.
        clock.now += 60
        heir_claim.append(store.claim(batch_size=10, lease_seconds=5))
        return Verdict.DELIVERED

    publisher = StubPublisher(take_over)
    r = relay(store, publisher)
    assert r.recovery is not None
    session = r.recovery.session()
    r.cycle()
    assert heir_claim[0].keys[0].doubt == (str(session),)
    assert [f.offset for f in store.floors()] == [0]
    assert r.recovery.session() != session
    assert sample(r, "outbox_acknowledged_unrecorded_total") == 1
    assert on_log(publisher) == ids


def test_a_requeue_below_what_a_dead_relay_sent_does_not_end_the_doubt_early() -> None:
    clock = Clock()
    store = InMemoryStore(clock)
    ids = enqueue(store, "a", 3)
    # The first event is discarded; the key goes on.
    refusing = StubPublisher(
        lambda m: (
            (Verdict.PERMANENT, "INVALID_RECORD: refused")
            if m.event_id == ids[0]
            else Verdict.UNSENT
        )
    )
    first = relay(store, refusing, batch_size=1)
    first.cycle()
    assert [e.status for e in store.events("a")] == ["discarded", "pending", "pending"]
    # A relay sends the other two and dies; an operator requeues the first meanwhile.
    publisher = StubPublisher()
    dead_relay_sent(store, publisher, clock, 2)
    assert store.requeue([ids[0]]) == 1
    # One event per claim: the requeued one is not on Kafka, the two after it are.
    heir = relay(store, publisher, batch_size=1)
    for _ in range(4):
        heir.cycle()
        clock.now += 10
    assert [e.status for e in store.events("a")] == ["delivered"] * 3
    assert sorted(on_log(publisher)) == sorted(ids)
    assert store.doubt("a") == []


def test_a_key_with_events_on_topics_of_different_sizes_goes_to_each_topics_own_partition() -> None:
    store = InMemoryStore()
    outbox = store.outbox(source="/tests")
    for topic in ("six", "two", "six", "two"):
        outbox.enqueue(None, type="x.y", key="customer-3", topic=topic, data={})
    publisher = StubPublisher(partitions={"six": 6, "two": 2})
    r = relay(store, publisher)
    for _ in range(4):
        r.cycle()
    sent = [m for send in publisher.sends for m in send]
    assert [m.topic for m in sent] == ["six", "two", "six", "two"]
    # customer-3 goes to partition 4 of six partitions, 0 of two.
    assert [m.partition for m in sent] == [
        key_partition(b"customer-3", 6),
        key_partition(b"customer-3", 2),
    ] * 2


class _FirstRecordFails(InMemoryStore):
    """Every record of the first claim that is recorded fails (a database gone for it)."""

    def __init__(self) -> None:
        super().__init__()
        self.failing: uuid.UUID | None = None
        self.attempts = threading.Semaphore(0)

    def record(self, token, keys, events, doubts=None):  # type: ignore[no-untyped-def]
        if self.failing is None:
            self.failing = token
        if token == self.failing:
            self.attempts.release()
            raise StorageError("connection refused")
        return super().record(token, keys, events, doubts)


def test_a_batch_whose_record_failed_keeps_the_floors_below_it() -> None:
    # Batch 2 is sent while batch 1's record retries. Stopped, batch 1's record gives
    # up; batch 2's then commits, and must not raise the session's floors past
    # batch 1's messages, or the heir's read-back would start above them and send
    # them again.
    store = _FirstRecordFails()
    for key in "abcdefgh":
        enqueue(store, key, 1)
    publisher = StubPublisher(partitions={"t": 1})
    r = relay(store, publisher, batch_size=4, shutdown_timeout=0.01)
    draining = threading.Thread(target=r.drain)
    draining.start()
    for _ in range(3):  # batch 1's record is being retried: batch 2 is out
        assert store.attempts.acquire(timeout=10)
    r.stop()
    draining.join(timeout=10)
    r.close()
    assert not draining.is_alive()
    assert [len(batch) for batch in publisher.sends] == [4, 4]
    assert sum(1 for e in store.events() if e.status == EventStatus.DELIVERED) == 4  # batch 2
    # Batch 1 landed at offsets 0-3 of the one partition: the floor stays at 0.
    assert [(f.partition, f.offset) for f in store.floors()] == [(0, 0)]
