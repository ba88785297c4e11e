"""What the store says is left and why (``remaining``), and what retention deletes
(``purge``)."""

from __future__ import annotations

import pytest

from outbox_kafka.relay.batch import EventOutcome, EventStatus, KeyOutcome, Remaining
from tests.contract.stores import StoreUnderTest, claim


def settle(
    under_test: StoreUnderTest,
    outcome: EventStatus,
    *,
    attempts: int = 1,
    delay: float = 0.0,
    error: str | None = None,
    park: bool = False,
    drained: bool = False,
) -> None:
    """Claim the one key due and record its first event so, the key delayed as the event."""
    taken = claim(under_test.store, batch_size=1)
    [key] = taken.keys
    event = key.events[0]
    next_seq = event.seq if outcome == EventStatus.PENDING or park else event.seq + 1
    partition, offset = (0, 1) if outcome == EventStatus.DELIVERED else (None, None)
    result = under_test.store.record(
        taken.token,
        [KeyOutcome(key.key, next_seq, delay, park, drained)],
        [EventOutcome(event.event_id, key.key, outcome, attempts, delay, partition, offset, error)],
    )
    assert result.keys_owned == 1


def test_an_empty_outbox_has_nothing_left(under_test: StoreUnderTest) -> None:
    assert under_test.store.remaining() == Remaining(
        pending=0,
        leased=0,
        parked=0,
        retrying=0,
        delayed=0,
        due=0,
        unreachable=0,
        next_due_seconds=None,
    )


def test_remaining_counts_each_pending_event_by_why_it_waits(under_test: StoreUnderTest) -> None:
    under_test.add("retrying")
    settle(under_test, EventStatus.PENDING, delay=60, error="broker away")
    under_test.add("held")
    settle(under_test, EventStatus.PENDING, attempts=0, delay=60, error="UNKNOWN_TOPIC: gone")
    under_test.add("parked", 2)
    settle(under_test, EventStatus.DISCARDED, park=True, error="refused")
    under_test.add("leased", 2)
    claim(under_test.store)
    under_test.add("delayed", delay=60)
    under_test.add("due", 3)
    left = under_test.store.remaining()
    assert left == Remaining(
        pending=9,
        leased=2,
        parked=1,
        retrying=1,
        delayed=2,
        due=3,
        unreachable=0,
        next_due_seconds=left.next_due_seconds,
        held=1,
        held_reason_count=1,
        held_reasons=("UNKNOWN_TOPIC: gone",),
    )
    assert left.next_due_seconds is not None and left.next_due_seconds <= 0.5


def test_the_next_key_due_is_counted_from_now(under_test: StoreUnderTest) -> None:
    under_test.add("k")
    settle(under_test, EventStatus.PENDING, delay=60, error="broker away")
    under_test.later(20)
    left = under_test.store.remaining()
    assert (left.pending, left.retrying) == (1, 1)
    assert left.next_due_seconds == pytest.approx(40.0, abs=1.0)


def test_a_parked_key_is_never_due(under_test: StoreUnderTest) -> None:
    under_test.add("k", 2)
    settle(under_test, EventStatus.DISCARDED, park=True, error="refused")
    left = under_test.store.remaining()
    assert (left.pending, left.parked, left.next_due_seconds) == (1, 1, None)


def test_purge_deletes_delivered_events_delivered_longer_ago_than_their_retention(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("old")
    settle(under_test, EventStatus.DELIVERED, attempts=0, drained=True)
    under_test.later(100)
    [recent] = under_test.add("recent")
    settle(under_test, EventStatus.DELIVERED, attempts=0, drained=True)
    [pending] = under_test.add("pending")
    under_test.later(10)
    removed = under_test.store.purge(delivered_seconds=50, discarded_seconds=10**6, batch=10)
    assert removed == 1
    assert [r.event_id for r in under_test.rows()] == [pending, recent]


def test_purge_deletes_discarded_events_written_longer_ago_than_their_retention(
    under_test: StoreUnderTest,
) -> None:
    """A discarded event's retention counts from when it was written, not from when
    it was discarded (as ``outbox-kafka purge`` documents it)."""
    under_test.add("a")
    under_test.add("b")
    under_test.later(100)
    [late] = under_test.add("c")
    for _ in range(3):
        settle(under_test, EventStatus.DISCARDED, error="refused")
    removed = under_test.store.purge(delivered_seconds=10**6, discarded_seconds=50, batch=10)
    assert removed == 2
    assert [r.event_id for r in under_test.rows()] == [late]


def test_purge_never_deletes_a_pending_event(under_test: StoreUnderTest) -> None:
    under_test.add("k", 2)
    settle(under_test, EventStatus.PENDING, delay=1, error="broker away")
    under_test.later(10**5)
    assert under_test.store.purge(delivered_seconds=0, discarded_seconds=0, batch=10) == 0
    assert [r.status for r in under_test.rows()] == ["pending", "pending"]


def test_a_key_whose_events_are_all_purged_starts_again_from_one(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    settle(under_test, EventStatus.DELIVERED, attempts=0, drained=True)
    under_test.later(100)
    assert under_test.store.purge(delivered_seconds=50, discarded_seconds=50, batch=10) == 1
    under_test.add("k")
    [key] = claim(under_test.store).keys
    assert (key.next_seq, [e.seq for e in key.events]) == (1, [1])


def test_a_key_still_in_the_queue_keeps_its_counter_through_a_purge(
    under_test: StoreUnderTest,
) -> None:
    """Its event was delivered and purged, but the key was handed back not drained:
    its next event follows on from the last sequence number, not from one."""
    under_test.add("k")
    settle(under_test, EventStatus.DELIVERED, attempts=0, drained=False)
    under_test.later(100)
    assert under_test.store.purge(delivered_seconds=50, discarded_seconds=50, batch=10) == 1
    under_test.add("k")
    [key] = claim(under_test.store).keys
    assert [e.seq for e in key.events] == [2]
