"""The store's claim: which keys it leases, in what order, which of their events come,
the byte budget, and leases that end."""

from __future__ import annotations

from outbox_kafka.relay.batch import Claim, KeyOutcome
from tests.contract.stores import StoreUnderTest, claim


def shape(taken: Claim) -> dict[str, tuple[list[int], bool]]:
    """Each claimed key: the sequence numbers of its events, and whether some were withheld."""
    return {k.key: ([e.seq for e in k.events], k.withheld) for k in taken.keys}


def test_nothing_to_claim_is_an_empty_claim(under_test: StoreUnderTest) -> None:
    taken = claim(under_test.store)
    assert (taken.keys, taken.event_count) == ([], 0)


def test_keys_are_leased_in_the_order_they_became_due_not_by_name(
    under_test: StoreUnderTest,
) -> None:
    for key in ["z", "a", "m"]:
        under_test.add(key)
    assert shape(claim(under_test.store, max_keys=2)) == {"a": ([1], False), "z": ([1], False)}
    assert shape(claim(under_test.store)) == {"m": ([1], False)}


def test_claimed_keys_come_in_key_order(under_test: StoreUnderTest) -> None:
    for key in ["c", "a", "b"]:
        under_test.add(key)
    assert [k.key for k in claim(under_test.store).keys] == ["a", "b", "c"]


def test_each_key_brings_its_next_events_in_order_up_to_its_share_of_the_batch(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("a", 5)
    under_test.add("b", 5)
    taken = claim(under_test.store, batch_size=4)
    assert taken.per_key_limit == 2
    assert shape(taken) == {"a": ([1, 2], False), "b": ([1, 2], False)}
    for key in taken.keys:
        assert (key.next_seq, key.last_seq, key.waiting_beyond_claim) == (1, 5, 3)


def test_a_claimed_event_carries_what_the_producer_stored(under_test: StoreUnderTest) -> None:
    [event_id] = under_test.add("k")
    [key] = claim(under_test.store).keys
    [event] = key.events
    assert (event.event_id, event.key, event.seq) == (event_id, "k", 1)
    assert (event.topic, event.type, event.attempts) == ("contract", "contract.e", 0)
    assert (event.due, event.wait_seconds) == (True, 0.0)
    assert event.headers is not None and ("x-n", b"0") in event.headers
    assert event_id.encode() in event.value


def test_a_leased_key_is_not_claimed_again_until_its_lease_ends(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k", 2)
    first = claim(under_test.store, lease_seconds=30)
    assert shape(first) == {"k": ([1, 2], False)}
    under_test.later(29)
    assert claim(under_test.store).keys == []
    under_test.later(2)
    second = claim(under_test.store)
    assert shape(second) == {"k": ([1, 2], False)}
    assert second.token != first.token


def test_an_event_written_with_a_delay_is_claimed_once_it_has_passed(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("k", delay=60)
    assert claim(under_test.store).keys == []
    under_test.later(61)
    assert shape(claim(under_test.store)) == {"k": ([1], False)}


def test_the_byte_budget_leaves_out_what_starts_past_it_and_marks_its_keys_withheld(
    under_test: StoreUnderTest,
) -> None:
    """Every key's first event, then every key's second, the keys in their due order:
    the first event always comes, and nothing that starts at or past the budget."""
    under_test.add("b", 3, size=2_000)
    under_test.add("a", 3, size=2_000)
    assert shape(claim(under_test.store, max_bytes=1_000)) == {
        "a": ([], True),
        "b": ([1], True),
    }


def test_a_budget_of_several_events_goes_round_robin(under_test: StoreUnderTest) -> None:
    under_test.add("b", 3, size=2_000)
    under_test.add("a", 3, size=2_000)
    # b's first, a's first, b's second start below 5 kB; a's second starts past it.
    assert shape(claim(under_test.store, max_bytes=5_000)) == {
        "a": ([1], True),
        "b": ([1, 2], True),
    }


def test_a_key_handed_back_unchanged_keeps_its_place_in_the_queue(
    under_test: StoreUnderTest,
) -> None:
    under_test.add("z", 2, size=2_000)
    under_test.add("a", 2, size=2_000)
    taken = claim(under_test.store, max_bytes=1_000)
    assert shape(taken) == {"a": ([], True), "z": ([1], True)}
    result = under_test.store.record(taken.token, [KeyOutcome.unchanged(k) for k in taken.keys], [])
    assert result.keys_owned == 2
    under_test.add("b")
    assert shape(claim(under_test.store, max_bytes=1_000, max_keys=1)) == {"z": ([1], True)}
