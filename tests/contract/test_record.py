"""The store's record: each event's new status, attempts, error and due time, each key's
next state, all fenced by the claim's token; and what operators' requeue and unpark
change."""

from __future__ import annotations

import pytest

from outbox_kafka.relay.batch import ClaimedKey, EventOutcome, EventStatus, KeyOutcome
from tests.contract.stores import Row, StoreUnderTest, claim


def delivered(key: ClaimedKey, position: int = 0, offset: int = 7) -> EventOutcome:
    event = key.events[position]
    return EventOutcome(event.event_id, key.key, EventStatus.DELIVERED, 0, 0.0, 3, offset, None)


def retried(
    key: ClaimedKey, error: str | None, *, attempts: int = 1, delay: float = 0.0
) -> EventOutcome:
    event = key.events[0]
    return EventOutcome(
        event.event_id, key.key, EventStatus.PENDING, attempts, delay, None, None, error
    )


def discarded(key: ClaimedKey, error: str = "refused for good") -> EventOutcome:
    event = key.events[0]
    return EventOutcome(event.event_id, key.key, EventStatus.DISCARDED, 1, 0.0, None, None, error)


def row(under_test: StoreUnderTest, event_id: str) -> Row:
    [found] = [r for r in under_test.rows() if r.event_id == event_id]
    return found


def test_a_delivered_event_keeps_its_partition_and_offset_and_a_drained_key_leaves(
    under_test: StoreUnderTest,
) -> None:
    [event_id] = under_test.add("k")
    taken = claim(under_test.store)
    [key] = taken.keys
    result = under_test.store.record(
        taken.token, [KeyOutcome("k", 2, 0.0, False, True)], [delivered(key)]
    )
    assert (result.keys_owned, result.keys_removed) == (1, 1)
    assert (result.delivered, result.discarded, result.retried) == (1, 0, 0)
    assert row(under_test, event_id) == Row(event_id, "k", 1, "delivered", 0, None, 3, 7)
    under_test.later(3600)
    assert claim(under_test.store).keys == []
    under_test.add("k")
    [again] = claim(under_test.store).keys
    assert (again.next_seq, [e.seq for e in again.events]) == (2, [2])


def test_each_delivered_event_reports_how_long_it_waited_since_it_was_written(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k", 2)
    taken = claim(under_test.store)
    [key] = taken.keys
    under_test.later(5)
    result = under_test.store.record(
        taken.token,
        [KeyOutcome("k", 3, 0.0, False, True)],
        [delivered(key, 0), delivered(key, 1, offset=8)],
    )
    assert result.latencies == [pytest.approx(5.0, abs=0.5)] * 2


def test_a_key_that_is_not_drained_resumes_from_its_next_sequence_number(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k", 3)
    taken = claim(under_test.store, batch_size=1)
    [key] = taken.keys
    result = under_test.store.record(
        taken.token, [KeyOutcome("k", 2, 0.0, False, False)], [delivered(key)]
    )
    assert (result.keys_owned, result.keys_removed, result.delivered) == (1, 0, 1)
    [again] = claim(under_test.store).keys
    assert (again.next_seq, [e.seq for e in again.events]) == (2, [2, 3])


def test_a_key_handed_back_with_nothing_left_is_claimed_empty_until_recorded_drained(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    taken = claim(under_test.store)
    [key] = taken.keys
    under_test.store.record(taken.token, [KeyOutcome("k", 2, 0.0, False, False)], [delivered(key)])
    taken = claim(under_test.store)
    assert [(k.key, k.next_seq, k.last_seq, k.events) for k in taken.keys] == [("k", 2, 1, [])]
    result = under_test.store.record(taken.token, [KeyOutcome("k", 2, 0.0, False, True)], [])
    assert (result.keys_owned, result.keys_removed) == (1, 1)
    assert claim(under_test.store).keys == []


def test_a_record_whose_lease_was_taken_over_changes_nothing(under_test: StoreUnderTest) -> None:
    [event_id] = under_test.add("k")
    first = claim(under_test.store, lease_seconds=5)
    under_test.later(6)
    second = claim(under_test.store, lease_seconds=30)
    [key] = second.keys
    stale = under_test.store.record(
        first.token, [KeyOutcome("k", 2, 0.0, False, True)], [delivered(key)]
    )
    assert (stale.keys_owned, stale.keys_removed, stale.delivered) == (0, 0, 0)
    assert row(under_test, event_id).status == "pending"
    assert claim(under_test.store).keys == []  # still the second claim's
    fresh = under_test.store.record(
        second.token, [KeyOutcome("k", 2, 0.0, False, True)], [delivered(key)]
    )
    assert (fresh.keys_owned, fresh.delivered) == (1, 1)
    assert row(under_test, event_id).status == "delivered"


def test_a_retry_counts_its_attempt_and_keeps_the_last_error_when_none_is_given(
    under_test: StoreUnderTest,
) -> None:
    [event_id] = under_test.add("k")
    taken = claim(under_test.store)
    [key] = taken.keys
    result = under_test.store.record(
        taken.token, [KeyOutcome("k", 1, 0.0, False, False)], [retried(key, "broker away")]
    )
    assert (result.keys_owned, result.retried) == (1, 1)
    assert row(under_test, event_id) == Row(
        event_id, "k", 1, "pending", 1, "broker away", None, None
    )
    taken = claim(under_test.store)
    [key] = taken.keys
    assert key.events[0].attempts == 1
    under_test.store.record(
        taken.token, [KeyOutcome("k", 1, 0.0, False, False)], [retried(key, None)]
    )
    assert row(under_test, event_id) == Row(
        event_id, "k", 1, "pending", 2, "broker away", None, None
    )


def test_a_retried_key_is_claimed_again_once_its_delay_has_passed(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    taken = claim(under_test.store)
    [key] = taken.keys
    under_test.store.record(
        taken.token, [KeyOutcome("k", 1, 10.0, False, False)], [retried(key, "x", delay=10.0)]
    )
    assert claim(under_test.store).keys == []
    under_test.later(11)
    [again] = claim(under_test.store).keys
    assert [(e.seq, e.attempts, e.due) for e in again.events] == [(1, 1, True)]


def test_an_event_not_yet_due_comes_with_its_wait_when_its_key_is(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    taken = claim(under_test.store)
    [key] = taken.keys
    under_test.store.record(
        taken.token, [KeyOutcome("k", 1, 0.0, False, False)], [retried(key, "x", delay=20.0)]
    )
    under_test.later(5)
    [again] = claim(under_test.store).keys
    [event] = again.events
    assert not event.due
    assert event.wait_seconds == pytest.approx(15.0, abs=1.0)


def test_a_discarded_event_keeps_its_reason_and_its_key_goes_on(
    under_test: StoreUnderTest,
) -> None:
    first, second = under_test.add("k", 2)
    taken = claim(under_test.store, batch_size=1)
    [key] = taken.keys
    result = under_test.store.record(
        taken.token, [KeyOutcome("k", 2, 0.0, False, False)], [discarded(key)]
    )
    assert (result.discarded, result.delivered, result.retried) == (1, 0, 0)
    assert row(under_test, first) == Row(
        first, "k", 1, "discarded", 1, "refused for good", None, None
    )
    [again] = claim(under_test.store).keys
    assert [e.event_id for e in again.events] == [second]


def test_a_parked_key_waits_for_an_operator_and_unpark_lets_it_go_on(
    under_test: StoreUnderTest,
) -> None:
    first, second = under_test.add("k", 2)
    taken = claim(under_test.store, batch_size=1)
    [key] = taken.keys
    under_test.store.record(taken.token, [KeyOutcome("k", 1, 0.0, True, False)], [discarded(key)])
    assert under_test.parked_keys() == ["k"]
    under_test.later(3600)
    assert claim(under_test.store).keys == []
    assert under_test.unpark(["k"]) == 1
    assert under_test.parked_keys() == []
    [again] = claim(under_test.store).keys
    assert [e.event_id for e in again.events] == [second]
    assert row(under_test, first).status == "discarded"


def test_unpark_counts_only_keys_that_were_parked(under_test: StoreUnderTest) -> None:
    under_test.add("k")
    assert under_test.unpark(["k", "nobody"]) == 0


def test_a_requeued_event_is_pending_again_with_a_fresh_start_and_its_key_resumes_from_it(
    under_test: StoreUnderTest,
) -> None:
    first, second = under_test.add("k", 2)
    taken = claim(under_test.store)
    [key] = taken.keys
    under_test.store.record(
        taken.token,
        [KeyOutcome("k", 3, 0.0, False, True)],
        [discarded(key), delivered(key, 1)],
    )
    assert under_test.requeue([first, second]) == 1  # a delivered event is not requeued
    assert row(under_test, first) == Row(first, "k", 1, "pending", 0, None, None, None)
    [again] = claim(under_test.store).keys
    assert (again.next_seq, [e.event_id for e in again.events]) == (1, [first])


def test_a_requeue_unparks_the_key_it_parked(under_test: StoreUnderTest) -> None:
    first, second = under_test.add("k", 2)
    taken = claim(under_test.store, batch_size=1)
    [key] = taken.keys
    under_test.store.record(taken.token, [KeyOutcome("k", 1, 0.0, True, False)], [discarded(key)])
    assert under_test.requeue([first]) == 1
    assert under_test.parked_keys() == []
    [again] = claim(under_test.store).keys
    assert [e.event_id for e in again.events] == [first, second]


def test_a_requeue_takes_a_key_back_from_the_relay_holding_it(under_test: StoreUnderTest) -> None:
    """The holder's record of the key is ignored, and nobody claims the key before
    the holder's lease ends."""
    first, second = under_test.add("k", 2)
    taken = claim(under_test.store, batch_size=1)
    [key] = taken.keys
    under_test.store.record(taken.token, [KeyOutcome("k", 2, 0.0, False, False)], [discarded(key)])
    holding = claim(under_test.store, lease_seconds=30)
    [held] = holding.keys
    assert under_test.requeue([first]) == 1
    result = under_test.store.record(
        holding.token, [KeyOutcome("k", 3, 0.0, False, True)], [delivered(held)]
    )
    assert (result.keys_owned, result.delivered) == (0, 0)
    assert row(under_test, second).status == "pending"
    assert claim(under_test.store).keys == []
    under_test.later(31)
    [again] = claim(under_test.store).keys
    assert [e.event_id for e in again.events] == [first, second]
