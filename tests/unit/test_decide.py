"""The relay's decisions before and after a send (outbox_kafka/relay/decide.py), as pure
functions: which events may go, what a key with nothing to send becomes, which
messages are too large, and the dead-letter copies. RetryPolicy.settle has its own
tests in test_settle.py."""

from __future__ import annotations

import random
import uuid

import pytest

from outbox_kafka.relay.batch import Claim, ClaimedEvent, ClaimedKey, KeyOutcome, Problem, Verdict
from outbox_kafka.relay.decide import (
    COPY_NOT_SENT,
    Discard,
    RetryPolicy,
    backoff_delay,
    dead_letter_messages,
    error_label,
    idle_key_outcome,
    note_copies,
    over_topic_limit,
    plan_batch,
    sendable,
)
from outbox_kafka.relay.ports import Delivery, Message


def event(
    seq: int, *, topic: str = "t", due: bool = True, attempts: int = 0, size: int = 10
) -> ClaimedEvent:
    return ClaimedEvent(
        str(uuid.uuid4()),
        "k",
        seq,
        topic,
        "x.y",
        b"v" * size,
        [("h", b"1")],
        attempts,
        due,
        0.0 if due else 7.0,
    )


def key(*events: ClaimedEvent, next_seq: int = 1, last_seq: int | None = None) -> ClaimedKey:
    claimed = ClaimedKey("k", next_seq, list(events), last_seq=last_seq, due_at=100.0)
    return claimed


def policy(max_attempts: int = 3) -> RetryPolicy:
    return RetryPolicy(
        max_attempts=max_attempts, park=False, backoff_base=0.5, backoff_cap=60, lease_seconds=30
    )


def no_problem(topic: str) -> Problem | None:
    return None


# ------------------------------------------------------------------------ sendable


def test_a_key_sends_its_due_events_in_order_up_to_one_not_due() -> None:
    first, second, later = event(1), event(2), event(3, due=False)
    assert sendable(key(first, second, later, event(4))) == [first, second]


def test_a_key_sends_only_its_first_run_of_one_topic() -> None:
    first, second = event(1, topic="a"), event(2, topic="a")
    assert sendable(key(first, second, event(3, topic="b"), event(4, topic="a"))) == [
        first,
        second,
    ]


def test_a_key_whose_first_event_is_not_due_sends_nothing() -> None:
    assert sendable(key(event(1, due=False), event(2))) == []


# ------------------------------------------------------------------------ backoff


def test_backoff_grows_exponentially_with_jitter_and_stays_under_the_cap() -> None:
    rng = random.Random(7)
    for attempt in range(1, 40):
        ceiling = min(60.0, 0.5 * 2 ** (attempt - 1))
        delays = [backoff_delay(attempt, 0.5, 60.0, rng) for _ in range(200)]
        assert all(ceiling / 2 <= d <= ceiling for d in delays)
        assert len(set(delays)) > 100  # jittered, not a constant
    assert backoff_delay(10_000, 0.5, 60.0, rng) <= 60.0


# ------------------------------------------------------------------------ idle keys


def test_a_key_the_budget_left_empty_is_handed_back_as_claimed() -> None:
    claimed = ClaimedKey("k", 4, [], last_seq=9, withheld=True, due_at=100.0)
    assert idle_key_outcome(claimed) == KeyOutcome("k", 4, 0.0, False, False, 100.0)


def test_a_key_whose_next_event_is_not_due_waits_for_it() -> None:
    assert idle_key_outcome(key(event(1, due=False))) == KeyOutcome("k", 1, 7.0, False, False)


def test_an_empty_key_is_drained_past_its_last_sequence_number() -> None:
    assert idle_key_outcome(key(next_seq=3, last_seq=5)) == KeyOutcome("k", 6, 0.0, False, True)
    assert idle_key_outcome(key(next_seq=3, last_seq=None)) == KeyOutcome("k", 3, 0.0, False, True)


# ------------------------------------------------------------------------ sizes and labels


def test_a_message_over_its_topics_limit_is_refused_for_good_saying_what_to_do() -> None:
    message = Message("t", b"k", b"v" * 100, [("h", b"1")])  # 1 + 100 + 2 bytes
    assert over_topic_limit(message, lambda topic: 103) is None
    assert over_topic_limit(message, lambda topic: None) is None
    problem = over_topic_limit(message, lambda topic: 102)
    assert problem is not None and problem[0] == Verdict.PERMANENT
    assert "103 bytes" in problem[1] and "(102)" in problem[1] and "requeue" in problem[1]


@pytest.mark.parametrize(
    ("error", "label"),
    [
        ("UNKNOWN_TOPIC: topic 't' does not exist", "UNKNOWN_TOPIC"),
        ("MSG_SIZE_TOO_LARGE", "MSG_SIZE_TOO_LARGE"),
        (None, "unknown"),
        ("", "unknown"),
        ("a message with spaces: and more", "other"),
        ("X" * 41 + ": too long a name", "other"),
    ],
)
def test_an_error_is_labelled_by_its_leading_name_or_other(error: str | None, label: str) -> None:
    assert error_label(error) == label


# ------------------------------------------------------------------------ the batch plan


def test_the_plan_sends_each_keys_events_up_to_its_first_problem() -> None:
    good, bad, behind = event(1), event(2), event(3)
    claimed = key(good, bad, behind)
    problem: Problem = (Verdict.RETRIABLE, "INVALID_ENVELOPE: no")
    plan = plan_batch(Claim(uuid.uuid4(), [claimed], 10), {id(bad): problem}, no_problem, policy())
    assert plan.events == [good]
    assert [m.event_id for m in plan.messages] == [good.event_id]
    assert plan.keys == [(claimed, [good, bad, behind])]
    assert plan.results.problems == {id(bad): problem}
    assert plan.discarded_first == []  # behind a good event: decided after the send


def test_the_plan_hands_back_keys_with_nothing_to_send() -> None:
    idle = ClaimedKey("i", 2, [], last_seq=1)
    plan = plan_batch(Claim(uuid.uuid4(), [idle], 10), {}, no_problem, policy())
    assert (plan.keys, plan.events) == ([], [])
    assert plan.idle_keys == [KeyOutcome("i", 2, 0.0, False, True)]


def test_a_first_event_given_up_before_the_send_is_discarded_with_the_send() -> None:
    first = event(1, attempts=2)
    plan = plan_batch(
        Claim(uuid.uuid4(), [key(first, event(2))], 10),
        {},
        lambda topic: (Verdict.RETRIABLE, "NOT_ENOUGH_REPLICAS: try later"),
        policy(max_attempts=3),
    )
    assert plan.events == []
    [discard] = plan.discarded_first
    assert (discard.event, discard.attempt) == (first, 3)
    assert discard.reason == "gave up after 3 attempts: NOT_ENOUGH_REPLICAS: try later"


def test_a_message_over_its_topics_limit_stops_its_key_in_the_plan() -> None:
    small, large = event(1, size=10), event(2, size=1_000)
    plan = plan_batch(
        Claim(uuid.uuid4(), [key(small, large)], 10), {}, no_problem, policy(), lambda t: 500
    )
    assert plan.events == [small]
    assert plan.results.problems[id(large)][0] == Verdict.PERMANENT


# ------------------------------------------------------------------------ dead-letter copies


def discard(seq: int = 1) -> Discard:
    return Discard(event(seq), 3, "gave up after 3 attempts: no", "no")


def test_without_a_dead_letter_topic_no_copy_is_needed() -> None:
    discards, copies = [discard()], {}
    assert dead_letter_messages(discards, None, no_problem, copies) == []
    assert copies == {id(discards[0].event): (Verdict.DELIVERED, None)}


def test_a_copy_says_why_and_where_from_and_keeps_the_events_key_value_and_headers() -> None:
    d = discard()
    copies: dict[int, tuple[Verdict, str | None]] = {}
    [copy] = dead_letter_messages([d], "dead", no_problem, copies)
    assert (copy.topic, copy.key, copy.value, copy.event_id) == (
        "dead",
        b"k",
        d.event.value,
        d.event.event_id,
    )
    assert copy.headers == [
        ("h", b"1"),
        ("outbox_error", b"gave up after 3 attempts: no"),
        ("outbox_original_topic", b"t"),
        ("outbox_event_id", d.event.event_id.encode()),
    ]
    assert copies == {}


def test_a_held_dead_letter_topic_makes_the_copy_retry_later() -> None:
    d, copies = discard(), {}
    held = lambda topic: (Verdict.HELD, "UNKNOWN_TOPIC: no dead")  # noqa: E731
    assert dead_letter_messages([d], "dead", held, copies) == []
    assert copies == {id(d.event): (Verdict.RETRIABLE, "UNKNOWN_TOPIC: no dead")}


def test_a_copy_too_large_for_the_dead_letter_topic_is_impossible() -> None:
    d, copies = discard(), {}
    assert dead_letter_messages([d], "dead", no_problem, copies, lambda topic: 20) == []
    assert copies[id(d.event)][0] == Verdict.PERMANENT


def test_how_the_copies_fared_is_noted_by_their_deliveries() -> None:
    unsent, unreported, reset, refused, landed = (discard(n) for n in range(1, 6))
    copies: dict[int, tuple[Verdict, str | None]] = {}
    discards = [unsent, unreported, reset, refused, landed]
    note_copies(
        discards,
        dead_letter_messages(discards, "dead", no_problem, {}),
        [
            Delivery(Verdict.UNSENT),
            Delivery(Verdict.UNREPORTED, sent=True),
            Delivery(Verdict.RESET, error="fenced", sent=True, reported=True),
            Delivery(Verdict.PERMANENT, error="too big", sent=True, reported=True),
            Delivery(Verdict.DELIVERED, sent=True, reported=True),
        ],
        copies,
    )
    assert copies == {
        id(unsent.event): COPY_NOT_SENT,
        id(unreported.event): (Verdict.RETRIABLE, "no delivery report for the dead-letter copy"),
        id(reset.event): (Verdict.RETRIABLE, "fenced"),
        id(refused.event): (Verdict.PERMANENT, "too big"),
        id(landed.event): (Verdict.DELIVERED, None),
    }
