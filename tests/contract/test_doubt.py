"""The store's bookkeeping for exactly once across crashes: which relay sessions a
key is in doubt about and up to which of its events, what ends a doubt, and each
session's floors (see "Exactly once across crashes" in
docs/explanation/guarantees.md).

Where a doubt ends is read from the outside: a record that moves the key's
next_seq to N ends it exactly when N is past the doubt's last event."""

from __future__ import annotations

import uuid

from outbox_kafka.relay.batch import (
    Claim,
    ClaimedKey,
    Doubts,
    EventOutcome,
    EventStatus,
    Floor,
    KeyOutcome,
)
from tests.contract.stores import StoreUnderTest, claim

#: Relay sessions, in the order their text sorts.
A, B, C, D, H = (uuid.UUID(int=n) for n in (0xA, 0xB, 0xC, 0xD, 0xE))


def lapsed(under_test: StoreUnderTest, session: uuid.UUID, *, batch_size: int = 100) -> Claim:
    """A claim by ``session`` whose lease runs out without a record."""
    taken = claim(under_test.store, session=session, lease_seconds=5, batch_size=batch_size)
    under_test.later(6)
    return taken


def claimed_key(under_test: StoreUnderTest, session: uuid.UUID) -> tuple[Claim, ClaimedKey]:
    """A claim by ``session`` of the one key due, and that key."""
    taken = claim(under_test.store, session=session)
    [key] = taken.keys
    return taken, key


def settle(
    under_test: StoreUnderTest,
    taken: Claim,
    next_seq: int,
    doubts: Doubts | None = None,
    *,
    drained: bool = False,
) -> int:
    """Record ``taken``'s one key as moved on to ``next_seq``; how many keys it owned."""
    [key] = taken.keys
    outcome = KeyOutcome(key.key, next_seq, 0.0, False, drained)
    return under_test.store.record(taken.token, [outcome], [], doubts).keys_owned


def discarded(key: ClaimedKey) -> EventOutcome:
    event = key.events[0]
    return EventOutcome(event.event_id, key.key, EventStatus.DISCARDED, 1, 0.0, None, None, "no")


def floor(session: uuid.UUID, partition: int, offset: int, topic: str = "contract") -> Floor:
    return Floor(str(session), topic, partition, 3, offset)


def floors_of(under_test: StoreUnderTest, *sessions: uuid.UUID) -> list[Floor]:
    return under_test.store.read_floors([str(s) for s in sessions], ["contract"])


# A claim that ends unrecorded ------------------------------------------------------


def test_a_key_whose_lease_ran_out_unrecorded_comes_back_in_doubt_about_that_claims_session(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    lapsed(under_test, A)
    _, key = claimed_key(under_test, B)
    assert key.doubt == (str(A),)
    assert under_test.doubt("k") == [str(A)]


def test_a_key_recorded_in_time_or_claimed_without_a_session_comes_back_in_no_doubt(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k", 3)
    taken = claim(under_test.store, session=A, batch_size=1)
    assert settle(under_test, taken, 2) == 1
    claim(under_test.store, lease_seconds=5)  # no session: nobody to be in doubt about
    under_test.later(6)
    _, key = claimed_key(under_test, C)
    assert key.doubt == ()
    assert under_test.doubt("k") == []


def test_each_lapsed_claim_adds_its_session_to_the_doubt_once_in_the_order_they_lapsed(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    lapsed(under_test, A)
    [again] = lapsed(under_test, A).keys
    assert again.doubt == (str(A),)
    [then] = lapsed(under_test, B).keys
    assert then.doubt == (str(A),)  # A's second lapse does not repeat it
    _, key = claimed_key(under_test, C)
    assert key.doubt == (str(A), str(B))


def test_the_doubt_covers_every_event_of_the_key_written_by_the_time_it_is_claimed_again(
    under_test: StoreUnderTest,
) -> None:
    """A claimed only the first event, but the doubt lasts up to the fifth: the events
    written before the key was claimed again count as sent by A, too."""
    under_test.add("k", 3)
    lapsed(under_test, A, batch_size=1)
    under_test.add("k", 2)
    taken, key = claimed_key(under_test, B)
    assert (key.doubt, key.next_seq, key.last_seq) == ((str(A),), 1, 5)
    assert settle(under_test, taken, 5) == 1
    assert under_test.doubt("k") == [str(A)]
    taken, key = claimed_key(under_test, C)
    assert key.doubt == (str(A),)
    assert settle(under_test, taken, 6) == 1
    assert under_test.doubt("k") == []
    _, key = claimed_key(under_test, D)
    assert key.doubt == ()


# What a record does to the doubt ---------------------------------------------------


def test_a_record_that_moves_next_seq_past_the_doubt_ends_it_and_one_that_does_not_keeps_it(
    under_test: StoreUnderTest,
) -> None:
    """The events written after the key was claimed again are not in the doubt."""
    under_test.add("k", 2)
    lapsed(under_test, A)
    taken, _ = claimed_key(under_test, B)
    under_test.add("k", 2)
    assert settle(under_test, taken, 2) == 1
    assert under_test.doubt("k") == [str(A)]
    taken, key = claimed_key(under_test, C)
    assert key.doubt == (str(A),)
    assert settle(under_test, taken, 3) == 1
    assert under_test.doubt("k") == []


def test_a_record_of_a_doubtful_outcome_puts_the_key_in_doubt_about_the_batchs_session(
    under_test: StoreUnderTest,
) -> None:
    """The first event acknowledged, the second and third may have landed unacknowledged:
    the doubt lasts up to the third."""
    under_test.add("k", 4)
    taken = claim(under_test.store, session=A)
    assert settle(under_test, taken, 2, Doubts(A, doubtful={"k": 3})) == 1
    assert under_test.doubt("k") == [str(A)]
    taken, key = claimed_key(under_test, B)
    assert key.doubt == (str(A),)
    assert settle(under_test, taken, 3) == 1
    assert under_test.doubt("k") == [str(A)]
    taken, _ = claimed_key(under_test, C)
    assert settle(under_test, taken, 4) == 1
    assert under_test.doubt("k") == []


def test_a_session_already_in_doubt_moves_last_when_its_batch_adds_it_again(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k", 2)
    lapsed(under_test, A)
    lapsed(under_test, B)
    taken, key = claimed_key(under_test, A)
    assert key.doubt == (str(A), str(B))
    assert settle(under_test, taken, 1, Doubts(A, doubtful={"k": 2})) == 1
    assert under_test.doubt("k") == [str(B), str(A)]
    _, key = claimed_key(under_test, C)
    assert key.doubt == (str(B), str(A))


def test_a_doubtful_record_that_passes_the_old_doubt_leaves_only_its_own_session(
    under_test: StoreUnderTest,
) -> None:
    """A's doubt (up to the second event) ends; B's lasts up to the fourth."""
    under_test.add("k", 2)
    lapsed(under_test, A)
    taken, _ = claimed_key(under_test, B)
    under_test.add("k", 2)
    assert settle(under_test, taken, 3, Doubts(B, doubtful={"k": 4})) == 1
    assert under_test.doubt("k") == [str(B)]
    taken, key = claimed_key(under_test, C)
    assert key.doubt == (str(B),)
    assert settle(under_test, taken, 4) == 1
    assert under_test.doubt("k") == [str(B)]
    taken, _ = claimed_key(under_test, D)
    assert settle(under_test, taken, 5) == 1
    assert under_test.doubt("k") == []


def test_a_record_whose_lease_was_taken_over_neither_ends_nor_adds_doubt(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    lapsed(under_test, A)
    late = lapsed(under_test, B)
    _, key = claimed_key(under_test, C)
    assert key.doubt == (str(A), str(B))
    assert settle(under_test, late, 2, Doubts(B, doubtful={"k": 1})) == 0
    assert settle(under_test, late, 2) == 0
    assert under_test.doubt("k") == [str(A), str(B)]


# What an operator's requeue does to the doubt --------------------------------------


def held_after_a_discard(under_test: StoreUnderTest, holder: uuid.UUID) -> tuple[str, str]:
    """Key k with two events, the first discarded, now held by ``holder`` (lease 30 s)."""
    first, second = under_test.add("k", 2)
    taken = claim(under_test.store, batch_size=1)
    [key] = taken.keys
    outcome = KeyOutcome("k", 2, 0.0, False, False)
    assert under_test.store.record(taken.token, [outcome], [discarded(key)]).keys_owned == 1
    claim(under_test.store, session=holder, lease_seconds=30)
    return first, second


def test_a_requeue_that_takes_a_key_from_its_holder_puts_it_in_doubt_about_the_holder(
    under_test: StoreUnderTest,
) -> None:
    """Up to the key's last event, though the requeue moves next_seq back to 1 (the
    holder may have sent the second event)."""
    first, second = held_after_a_discard(under_test, H)
    assert under_test.requeue([first]) == 1
    assert under_test.doubt("k") == [str(H)]
    under_test.later(31)
    taken, key = claimed_key(under_test, C)
    assert key.doubt == (str(H),)
    assert [e.event_id for e in key.events] == [first, second]
    assert settle(under_test, taken, 2) == 1
    assert under_test.doubt("k") == [str(H)]
    taken, _ = claimed_key(under_test, D)
    assert settle(under_test, taken, 3) == 1
    assert under_test.doubt("k") == []


def test_a_requeue_after_the_holders_lease_ran_out_still_carries_its_session(
    under_test: StoreUnderTest,
) -> None:
    first, _ = held_after_a_discard(under_test, H)
    under_test.later(31)
    assert under_test.requeue([first]) == 1
    assert under_test.doubt("k") == [str(H)]
    _, key = claimed_key(under_test, C)
    assert key.doubt == (str(H),)  # not added twice by the claim


def test_a_requeue_of_a_key_nobody_holds_adds_no_doubt(under_test: StoreUnderTest) -> None:
    first, _ = under_test.add("k", 2)
    taken = claim(under_test.store, session=A, batch_size=1)
    [key] = taken.keys
    outcome = KeyOutcome("k", 2, 0.0, False, False)
    assert under_test.store.record(taken.token, [outcome], [discarded(key)]).keys_owned == 1
    assert under_test.requeue([first]) == 1
    assert under_test.doubt("k") == []
    _, key = claimed_key(under_test, C)
    assert key.doubt == ()


# Floors ----------------------------------------------------------------------------


def test_open_floors_writes_new_floors_and_keeps_an_existing_ones_value(
    under_test: StoreUnderTest,
) -> None:
    under_test.store.open_floors(A, [floor(A, 0, 10)])
    under_test.store.open_floors(A, [floor(A, 0, 3), floor(A, 1, 7)])
    under_test.store.open_floors(B, [floor(B, 0, 1)])
    assert floors_of(under_test, A) == [floor(A, 0, 10), floor(A, 1, 7)]


def test_read_floors_returns_the_sessions_and_topics_asked_for_by_topic_partition_session(
    under_test: StoreUnderTest,
) -> None:
    under_test.store.open_floors(B, [floor(B, 1, 5), floor(B, 0, 4)])
    under_test.store.open_floors(A, [floor(A, 0, 2), floor(A, 0, 9, topic="other")])
    under_test.store.open_floors(C, [floor(C, 0, 1)])
    assert under_test.store.read_floors([str(B), str(A)], ["contract", "other"]) == [
        floor(A, 0, 2),
        floor(B, 0, 4),
        floor(B, 1, 5),
        floor(A, 0, 9, topic="other"),
    ]
    assert under_test.store.read_floors([str(D)], ["contract"]) == []


def test_a_record_that_owns_its_keys_raises_the_sessions_floors_and_never_lowers_one(
    under_test: StoreUnderTest,
) -> None:
    """Nor does it write a floor the session never opened, nor one of another session."""
    under_test.store.open_floors(A, [floor(A, 0, 10), floor(A, 1, 20)])
    under_test.store.open_floors(B, [floor(B, 0, 10)])
    under_test.add("k")
    taken = claim(under_test.store, session=A)
    raised = {("contract", 0): 15, ("contract", 1): 5, ("contract", 2): 9}
    assert settle(under_test, taken, 2, Doubts(A, floors=raised), drained=True) == 1
    assert floors_of(under_test, A, B) == [floor(A, 0, 15), floor(B, 0, 10), floor(A, 1, 20)]


def test_a_record_that_lost_one_of_its_keys_raises_no_floor(under_test: StoreUnderTest) -> None:
    """An operator's requeue takes key b from A's claim: A's record of key a still
    counts, but no floor of A moves."""
    [b_first] = under_test.add("b")
    taken = claim(under_test.store)
    [b] = taken.keys
    outcome = KeyOutcome("b", 2, 0.0, False, False)
    assert under_test.store.record(taken.token, [outcome], [discarded(b)]).keys_owned == 1
    under_test.add("a")
    under_test.store.open_floors(A, [floor(A, 0, 10)])
    taken = claim(under_test.store, session=A)
    assert [k.key for k in taken.keys] == ["a", "b"]
    assert under_test.requeue([b_first]) == 1
    result = under_test.store.record(
        taken.token,
        [KeyOutcome("a", 2, 0.0, False, False), KeyOutcome("b", 2, 0.0, False, False)],
        [],
        Doubts(A, floors={("contract", 0): 15}),
    )
    assert result.keys_owned == 1
    assert floors_of(under_test, A) == [floor(A, 0, 10)]
    # The next batch of A owns its one key: its floor moves.
    under_test.add("a")
    taken, key = claimed_key(under_test, A)
    assert key.key == "a"
    assert settle(under_test, taken, 3, Doubts(A, floors={("contract", 0): 15})) == 1
    assert floors_of(under_test, A) == [floor(A, 0, 15)]


def test_a_late_record_whose_lease_was_taken_over_raises_no_floor(
    under_test: StoreUnderTest,
) -> None:
    under_test.store.open_floors(A, [floor(A, 0, 10)])
    under_test.add("k")
    late = lapsed(under_test, A)
    claimed_key(under_test, B)
    assert settle(under_test, late, 2, Doubts(A, floors={("contract", 0): 15})) == 0
    assert floors_of(under_test, A) == [floor(A, 0, 10)]


# Forgetting floors -----------------------------------------------------------------


def test_forget_floors_deletes_the_old_floors_no_key_names_and_keeps_younger_ones(
    under_test: StoreUnderTest,
) -> None:
    under_test.store.open_floors(A, [floor(A, 0, 1), floor(A, 1, 2)])
    under_test.later(100)
    under_test.store.open_floors(B, [floor(B, 0, 3)])
    under_test.later(10)
    under_test.store.forget_floors(50)
    assert floors_of(under_test, A, B) == [floor(B, 0, 3)]


def test_forget_floors_deletes_every_floor_of_a_session_older_than_asked(
    under_test: StoreUnderTest,
) -> None:
    """A session is as old as its first floor: the floor it opened later goes with it."""
    under_test.store.open_floors(A, [floor(A, 0, 1)])
    under_test.later(100)
    under_test.store.open_floors(A, [floor(A, 1, 2)])
    under_test.store.forget_floors(50)
    assert floors_of(under_test, A) == []


def test_forget_floors_keeps_the_floors_of_a_session_a_keys_doubt_names_until_it_ends(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k")
    under_test.store.open_floors(A, [floor(A, 0, 1)])
    under_test.store.open_floors(B, [floor(B, 0, 1)])
    lapsed(under_test, A)
    taken, key = claimed_key(under_test, B)
    assert key.doubt == (str(A),)
    under_test.later(100)
    under_test.store.forget_floors(50)
    # A is in k's doubt; B holds k's claim.
    assert floors_of(under_test, A, B) == [floor(A, 0, 1), floor(B, 0, 1)]
    assert settle(under_test, taken, 2) == 1
    under_test.store.forget_floors(50)
    assert floors_of(under_test, A, B) == []


def test_forget_floors_keeps_the_floors_of_a_claims_session_while_its_token_is_set(
    under_test: StoreUnderTest,
) -> None:
    """Even past the claim's lease: the key's next claim puts it in doubt about it."""
    under_test.add("k")
    taken = lapsed(under_test, A)
    under_test.store.open_floors(A, [floor(A, 0, 1)])
    under_test.later(100)
    under_test.store.forget_floors(50)
    assert floors_of(under_test, A) == [floor(A, 0, 1)]
    assert settle(under_test, taken, 2, drained=True) == 1
    under_test.store.forget_floors(50)
    assert floors_of(under_test, A) == []
