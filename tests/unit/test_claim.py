"""The claim stage's own decisions (outbox_kafka/relay/claim.py): how many keys the next
claim asks for, and whether to read a claim ahead (no services)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

import pytest

from outbox_kafka.relay.batch import Claim, ClaimedEvent, ClaimedKey
from outbox_kafka.relay.claim import ClaimSizer, decode_envelope, worth_reading_ahead


def _event(key: str, seq: int, topic: str = "t") -> ClaimedEvent:
    return ClaimedEvent(str(uuid.uuid4()), key, seq, topic, "x", b"{}", [], 0, True, 0.0)


def _claim(
    events_per_key: list[int],
    per_key_limit: int,
    waiting: list[int] | None = None,
    topics: tuple[str, ...] = ("t",),
) -> Claim:
    """Keys from next_seq 1 with these many events claimed (and, if given, waiting);
    each key's events take ``topics`` in turn."""
    keys = [
        ClaimedKey(
            f"k{i}",
            1,
            [_event(f"k{i}", s + 1, topics[s % len(topics)]) for s in range(n)],
            None if waiting is None else waiting[i],
        )
        for i, n in enumerate(events_per_key)
    ]
    return Claim(uuid.uuid4(), keys, per_key_limit)


@pytest.fixture
def sizer() -> ClaimSizer:
    return ClaimSizer(batch_size=1000)


def test_claims_fewer_keys_when_every_key_has_more_waiting(sizer: ClaimSizer) -> None:
    assert sizer.keys_per_claim == 1000
    sizer.adapt(_claim([1] * 1000, per_key_limit=1), 1000)
    assert sizer.keys_per_claim == 500


def test_claims_fewer_keys_when_fewer_keys_than_asked_each_have_more_waiting(
    sizer: ClaimSizer,
) -> None:
    # 300 keys with a deep backlog each: 3 events per key per claim is mostly key overhead.
    sizer.adapt(_claim([3] * 300, per_key_limit=3), 1000)
    assert sizer.keys_per_claim == 150
    sizer.adapt(_claim([6] * 150, per_key_limit=6), 150)
    assert sizer.keys_per_claim == 75


def test_goes_straight_to_enough_keys_for_a_full_batch_when_backlogs_are_known(
    sizer: ClaimSizer,
) -> None:
    # 1,000 keys with 5 events waiting each, one claimed of each: 200 keys fill the batch.
    sizer.adapt(_claim([1] * 1000, per_key_limit=1, waiting=[5] * 1000), 1000)
    assert sizer.keys_per_claim == 200
    # 200 keys x 5 events, nothing more waiting: stay.
    sizer.adapt(_claim([5] * 200, per_key_limit=5, waiting=[5] * 200), 200)
    assert sizer.keys_per_claim == 200


def test_keys_with_nothing_more_waiting_do_not_shrink_the_claim(sizer: ClaimSizer) -> None:
    sizer.keys_per_claim = 400
    sizer.adapt(_claim([2] * 400, per_key_limit=2, waiting=[2] * 400), 400)
    assert sizer.keys_per_claim == 400


def test_claims_more_keys_again_when_keys_run_short(sizer: ClaimSizer) -> None:
    sizer.keys_per_claim = 125
    sizer.adapt(_claim([3] * 125, per_key_limit=8), 125)
    assert sizer.keys_per_claim == 250


def test_a_lone_hot_key_does_not_shrink_the_claim(sizer: ClaimSizer) -> None:
    sizer.adapt(_claim([1000], per_key_limit=1000), 1000)
    assert sizer.keys_per_claim == 1000


def test_never_below_the_floor(sizer: ClaimSizer) -> None:
    sizer.keys_per_claim = 15
    sizer.adapt(_claim([66] * 15, per_key_limit=66), 15)
    assert sizer.keys_per_claim == 15


def test_keys_whose_events_switch_topics_do_not_shrink_the_claim(sizer: ClaimSizer) -> None:
    # Each key brings 5 events but can send only its first (the next is for another
    # topic and waits for the next batch): more keys per claim, not fewer.
    sizer.keys_per_claim = 200
    claim = _claim([5] * 200, per_key_limit=5, waiting=[50] * 200, topics=("a", "b"))
    sizer.adapt(claim, 200)
    assert sizer.keys_per_claim == 400


def test_a_claim_is_read_ahead_when_it_filled_half_the_batch() -> None:
    assert worth_reading_ahead(_claim([5, 5], 10), asked=100, batch_size=20)
    assert not worth_reading_ahead(_claim([4, 5], 10), asked=100, batch_size=20)


def test_a_claim_is_read_ahead_when_it_ran_out_of_keys_to_ask_for() -> None:
    assert worth_reading_ahead(_claim([1, 1], 10), asked=2, batch_size=100)


def test_no_claim_is_read_ahead_when_nothing_claimed_is_due() -> None:
    claim = _claim([5, 5], 10)
    for k in claim.keys:
        k.events[:] = [e._replace(due=False) for e in k.events]
    assert not worth_reading_ahead(claim, asked=2, batch_size=10)
    assert not worth_reading_ahead(_claim([], 10), asked=2, batch_size=10)


@pytest.mark.parametrize(
    "text",
    [
        '{"a": 1}',
        ' {"a": 1}',
        '{"a": 1}\n',
        '\t{"a": [1, 2]} ',
        '{"a": 1} x',
        '{"a": 1}{"b": 2}',
        '{"a": ',
        "",
        "   ",
        "nan",
        "NaN",
        '"text"',
        "[" * 100_000,
    ],
)
def test_an_envelope_decodes_as_json_loads_decodes_it(text: str) -> None:
    """The envelope check's decoder takes its short path only where json.loads would
    give the same value; everywhere else it gives what json.loads gives, error included."""

    def outcome(decode: Callable[[str], object]) -> object:
        try:
            return ("value", decode(text))
        except RecursionError:
            return ("too deep",)
        except ValueError as exc:
            return ("error", str(exc))

    assert outcome(decode_envelope) == outcome(json.loads)
