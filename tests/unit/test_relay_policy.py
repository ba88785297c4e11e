"""The relay's pure decisions: backoff and how many keys to claim (no services)."""

from __future__ import annotations

import random
import time
import uuid
from typing import Any, cast

import pytest

from outbox_kafka.relay.loop import Relay, backoff_delay
from outbox_kafka.relay.publisher import DELIVERED, PERMANENT, RETRIABLE, Delivery, Message
from outbox_kafka.relay.settings import RelaySettings
from outbox_kafka.relay.store import Claim, ClaimedEvent, ClaimedKey


def test_backoff_grows_exponentially_with_jitter_and_stays_under_the_cap() -> None:
    rng = random.Random(7)
    for attempt in range(1, 40):
        ceiling = min(60.0, 0.5 * 2 ** (attempt - 1))
        delays = [backoff_delay(attempt, 0.5, 60.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 100  # jittered, not a constant
    assert backoff_delay(10_000, 0.5, 60.0, rng) <= 60.0


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
def relay() -> Relay:
    settings = RelaySettings(database_url="postgresql://unused/db", bootstrap_servers="unused:1")
    return Relay(settings, store=cast(Any, object()), publisher=cast(Any, object()))


def test_claims_fewer_keys_when_every_key_has_more_waiting(relay: Relay) -> None:
    assert relay._keys_per_claim == 1000
    relay._adapt_keys_per_claim(_claim([1] * 1000, per_key_limit=1), 1000)
    assert relay._keys_per_claim == 500


def test_claims_fewer_keys_when_fewer_keys_than_asked_each_have_more_waiting(
    relay: Relay,
) -> None:
    # 300 keys with a deep backlog each: 3 events per key per claim is mostly key overhead.
    relay._adapt_keys_per_claim(_claim([3] * 300, per_key_limit=3), 1000)
    assert relay._keys_per_claim == 150
    relay._adapt_keys_per_claim(_claim([6] * 150, per_key_limit=6), 150)
    assert relay._keys_per_claim == 75


def test_goes_straight_to_enough_keys_for_a_full_batch_when_backlogs_are_known(
    relay: Relay,
) -> None:
    # 1,000 keys with 5 events waiting each, one claimed of each: 200 keys fill the batch.
    relay._adapt_keys_per_claim(_claim([1] * 1000, per_key_limit=1, waiting=[5] * 1000), 1000)
    assert relay._keys_per_claim == 200
    # 200 keys x 5 events, nothing more waiting: stay.
    relay._adapt_keys_per_claim(_claim([5] * 200, per_key_limit=5, waiting=[5] * 200), 200)
    assert relay._keys_per_claim == 200


def test_keys_with_nothing_more_waiting_do_not_shrink_the_claim(relay: Relay) -> None:
    relay._keys_per_claim = 400
    relay._adapt_keys_per_claim(_claim([2] * 400, per_key_limit=2, waiting=[2] * 400), 400)
    assert relay._keys_per_claim == 400


def test_claims_more_keys_again_when_keys_run_short(relay: Relay) -> None:
    relay._keys_per_claim = 125
    relay._adapt_keys_per_claim(_claim([3] * 125, per_key_limit=8), 125)
    assert relay._keys_per_claim == 250


def test_a_lone_hot_key_does_not_shrink_the_claim(relay: Relay) -> None:
    relay._adapt_keys_per_claim(_claim([1000], per_key_limit=1000), 1000)
    assert relay._keys_per_claim == 1000


def test_never_below_the_floor(relay: Relay) -> None:
    relay._keys_per_claim = 15
    relay._adapt_keys_per_claim(_claim([66] * 15, per_key_limit=66), 15)
    assert relay._keys_per_claim == 15


def test_keys_whose_events_switch_topics_do_not_shrink_the_claim(relay: Relay) -> None:
    # Each key brings 5 events but can send only its first (the next is for another
    # topic and waits for the next batch): more keys per claim, not fewer.
    relay._keys_per_claim = 200
    claim = _claim([5] * 200, per_key_limit=5, waiting=[50] * 200, topics=("a", "b"))
    relay._adapt_keys_per_claim(claim, 200)
    assert relay._keys_per_claim == 400


# --------------------------------------------------------------------------- dead letters


class _Broker:
    """A publisher that records each send and answers main-topic messages with ``verdict``."""

    def __init__(self, verdict: str) -> None:
        self.verdict = verdict
        self.sends: list[list[Message]] = []

    def topic_problem(self, topic: str) -> None:
        return None

    def send(self, messages: list[Message], **_: Any) -> list[Delivery]:
        self.sends.append(list(messages))
        return [
            Delivery(
                verdict=DELIVERED if m.topic == "dlq" else self.verdict,
                partition=0,
                offset=n,
                error=None if m.topic == "dlq" or self.verdict == DELIVERED else "TIMED_OUT",
                sent=True,
                reported=True,
            )
            for n, m in enumerate(messages)
        ]


def _dead_lettering_relay(broker: _Broker) -> Relay:
    settings = RelaySettings(
        database_url="postgresql://unused/db", bootstrap_servers="unused:1", dead_letter_topic="dlq"
    )
    return Relay(settings, store=cast(Any, object()), publisher=cast(Any, broker))


def _outcomes(relay: Relay, claim: Claim, problems: dict[int, tuple[str, str]]) -> dict[int, str]:
    _, outcomes, _ = relay._publish(claim, problems, time.monotonic() + 60)
    seqs = {e.event_id: e.seq for k in claim.keys for e in k.events}
    return {seqs[o.event_id]: o.status for o in outcomes}


def test_an_invalid_event_behind_one_that_fails_gets_no_dead_letter_copy() -> None:
    """Key k0: event 1 times out, event 2 is invalid. Event 2 is not discarded in
    this batch (its key is held at event 1), so no copy of it may be made."""
    broker = _Broker(RETRIABLE)
    relay = _dead_lettering_relay(broker)
    claim = _claim([2], per_key_limit=10)
    invalid = claim.keys[0].events[1]
    outcomes = _outcomes(relay, claim, {id(invalid): (PERMANENT, "INVALID_ENVELOPE: x")})
    assert outcomes == {1: "pending"}
    assert [m.topic for send in broker.sends for m in send] == ["t"]


def test_an_invalid_event_behind_delivered_ones_is_copied_after_the_send() -> None:
    broker = _Broker(DELIVERED)
    relay = _dead_lettering_relay(broker)
    claim = _claim([2], per_key_limit=10)
    invalid = claim.keys[0].events[1]
    outcomes = _outcomes(relay, claim, {id(invalid): (PERMANENT, "INVALID_ENVELOPE: x")})
    assert outcomes == {1: "delivered", 2: "discarded"}
    assert [[m.topic for m in send] for send in broker.sends] == [["t"], ["dlq"]]


def test_a_key_whose_first_event_is_invalid_has_its_copy_sent_with_the_batch() -> None:
    broker = _Broker(DELIVERED)
    relay = _dead_lettering_relay(broker)
    claim = _claim([1, 1], per_key_limit=10)
    invalid, valid = claim.keys[0].events[0], claim.keys[1].events[0]
    _, outcomes, _ = relay._publish(
        claim, {id(invalid): (PERMANENT, "INVALID_ENVELOPE: x")}, time.monotonic() + 60
    )
    assert {o.event_id: o.status for o in outcomes} == {
        invalid.event_id: "discarded",
        valid.event_id: "delivered",
    }
    assert [sorted(m.topic for m in send) for send in broker.sends] == [["dlq", "t"]]
