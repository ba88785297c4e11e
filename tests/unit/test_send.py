"""Sending one claimed batch (outbox_kafka/relay/send.py): what goes out, in how many
sends, and what each key and event becomes; on the in-memory store and the stub
publisher (no services)."""

from __future__ import annotations

import time

import pytest

from outbox_kafka.relay.batch import Claim, KeyOutcome, Verdict
from outbox_kafka.relay.claim import Claimed, Claimer
from outbox_kafka.relay.decide import RetryPolicy
from outbox_kafka.relay.lease import Lease
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.relay.ports import Message
from outbox_kafka.relay.send import BatchSender
from outbox_kafka.testing import InMemoryStore, StubPublisher
from tests.fakes_support import enqueue

LEASE = Lease(seconds=30.0, delivery_timeout=20.0)
TIMED_OUT = (Verdict.RETRIABLE, "REQUEST_TIMED_OUT: slow")


class _Skips(RelayObserver):
    def __init__(self) -> None:
        self.skipped: list[int] = []

    def send_skipped(self, messages: int, lease_left: float) -> None:
        self.skipped.append(messages)


def _sender(kafka: StubPublisher, observer: RelayObserver | None = None) -> BatchSender:
    return BatchSender(
        kafka,
        RetryPolicy(max_attempts=3, park=False, backoff_base=0.5, backoff_cap=60, lease_seconds=30),
        observer or RelayObserver(),
        dead_letter_topic="dlq",
        lease=LEASE,
        abort=lambda: False,
    )


def _claimed(store: InMemoryStore) -> Claimed:
    """The store's next claim, checked as the relay checks it, asked for now."""

    def take(max_keys: int) -> Claim:
        return store.claim(batch_size=100, lease_seconds=LEASE.seconds, max_keys=max_keys)

    claimer = Claimer(take, batch_size=100, max_message_bytes=1 << 20, observer=RelayObserver())
    return claimer.claim()


def _topics_and_keys(messages: list[Message]) -> list[tuple[str, bytes]]:
    return [(m.topic, m.key) for m in messages]


def test_a_batch_whose_events_all_arrive_goes_in_one_send_and_every_key_moves_on() -> None:
    store, kafka = InMemoryStore(), StubPublisher()
    ids = enqueue(store, "a", 2) + enqueue(store, "b", 1)
    _, sent = _sender(kafka).send_claimed(_claimed(store))
    assert [_topics_and_keys(send) for send in kafka.sends] == [
        [("t", b"a"), ("t", b"a"), ("t", b"b")]
    ]
    assert [(e.event_id, e.status, e.offset) for e in sent.events] == [
        (ids[0], "delivered", 0),
        (ids[1], "delivered", 1),
        (ids[2], "delivered", 2),
    ]
    assert [(k.key, k.next_seq, k.drained) for k in sent.keys] == [("a", 3, True), ("b", 2, True)]


def test_a_retriable_failure_retries_its_event_and_holds_the_rest_of_its_key() -> None:
    store = InMemoryStore()
    kafka = StubPublisher(lambda m: TIMED_OUT if m.key == b"a" else Verdict.DELIVERED)
    first = enqueue(store, "a", 3)[0]
    enqueue(store, "b", 1)
    _, sent = _sender(kafka).send_claimed(_claimed(store))
    a_events = [e for e in sent.events if e.key == "a"]
    # Only the first is settled: one attempt counted, its error kept, a backoff drawn.
    assert [(e.event_id, e.status, e.attempts_added) for e in a_events] == [(first, "pending", 1)]
    assert a_events[0].error == TIMED_OUT[1] and a_events[0].delay > 0
    a_key, b_key = sent.keys
    assert (a_key.next_seq, a_key.drained) == (1, False) and a_key.delay == a_events[0].delay
    assert (b_key.next_seq, b_key.drained) == (2, True)
    assert len(kafka.sends) == 1  # no second send for a retry


def test_a_permanent_failure_is_discarded_with_a_dead_letter_copy_in_a_second_send() -> None:
    store = InMemoryStore()
    refused, after = enqueue(store, "a", 2)
    invalid = (Verdict.PERMANENT, "INVALID_RECORD: refused")
    kafka = StubPublisher(
        lambda m: invalid if (m.topic, m.event_id) == ("t", refused) else Verdict.DELIVERED
    )
    _, sent = _sender(kafka).send_claimed(_claimed(store))
    assert [_topics_and_keys(send) for send in kafka.sends] == [
        [("t", b"a"), ("t", b"a")],
        [("dlq", b"a")],
    ]
    (copy,) = kafka.messages("dlq")
    assert dict(copy.headers)["outbox_event_id"] == refused.encode()
    assert dict(copy.headers)["outbox_error"] == b"INVALID_RECORD: refused"
    assert [(e.event_id, e.status, e.error) for e in sent.events] == [
        (refused, "discarded", "INVALID_RECORD: refused"),
        (after, "delivered", None),
    ]
    assert (sent.keys[0].next_seq, sent.keys[0].drained) == (3, True)


@pytest.mark.parametrize(("asked_ago", "sends"), [(9.0, 1), (11.0, 0)])
def test_a_send_starts_only_with_one_delivery_timeout_of_the_lease_left(
    asked_ago: float, sends: int
) -> None:
    # Lease 30 s, delivery timeout 20 s: 21 s left may send, 19 s may not.
    store, kafka, skips = InMemoryStore(), StubPublisher(), _Skips()
    enqueue(store, "a", 2)
    claimed = _claimed(store)
    claimed = claimed._replace(asked_at=time.monotonic() - asked_ago)
    _, sent = _sender(kafka, skips).send_claimed(claimed)
    assert len(kafka.sends) == sends
    # Only events handed to the producer count as sent (a cycle that sent none
    # made no progress).
    assert sent.sent == 2 * sends
    if sends == 0:
        assert skips.skipped == [2]
        # Nothing settled: the key goes back as it was claimed, keeping its place.
        assert sent.events == []
        assert sent.keys == [KeyOutcome.unchanged(k) for k in claimed.claim.keys]


def test_sent_counts_the_events_handed_over_not_their_dead_letter_copies() -> None:
    store = InMemoryStore()
    kafka = StubPublisher(lambda m: TIMED_OUT if m.key == b"c" else Verdict.DELIVERED)
    enqueue(store, "a", 2)
    store.append("b", "t", b"not an envelope")  # discarded before the send
    enqueue(store, "c", 1)  # answered with a retriable error
    _, sent = _sender(kafka).send_claimed(_claimed(store))
    # The invalid event's copy goes with the batch: one send of 3 events and 1 copy.
    assert [sorted(m.topic for m in send) for send in kafka.sends] == [["dlq", "t", "t", "t"]]
    assert sent.sent == 3
    assert [(e.key, e.status) for e in sent.events] == [
        ("a", "delivered"),
        ("a", "delivered"),
        ("b", "discarded"),
        ("c", "pending"),
    ]
    assert [k.key for k in sent.keys] == ["a", "b", "c"]


def test_a_message_refused_with_its_record_batch_is_sent_alone_and_only_it_is_discarded() -> None:
    store = InMemoryStore()
    poisoned = enqueue(store, "a", 1)[0]
    enqueue(store, "b", 1)
    refused = (Verdict.BATCH_REJECTED, "INVALID_RECORD: batch")

    def answer(message: Message) -> Verdict | tuple[Verdict, str]:
        # The broker refuses the first send whole, and the poisoned message again alone.
        first_send = len(kafka.sends) == 1
        if message.topic == "t" and (first_send or message.event_id == poisoned):
            return refused
        return Verdict.DELIVERED

    kafka = StubPublisher(answer)
    _, sent = _sender(kafka).send_claimed(_claimed(store))
    assert [_topics_and_keys(send) for send in kafka.sends] == [
        [("t", b"a"), ("t", b"b")],  # refused together
        [("t", b"a")],  # a alone: refused again, so it is at fault
        [("t", b"b")],  # b alone: delivered
        [("dlq", b"a")],
    ]
    assert [(e.key, e.status) for e in sent.events] == [("a", "discarded"), ("b", "delivered")]
    assert "refused when sent alone" in (sent.events[0].error or "")
