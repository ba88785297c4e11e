"""Planning one batch: which events go to Kafka, which keys have nothing to send, and
the dead-letter copies of discarded events. Pure: the topic lookups come in as a function."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from outbox_kafka.relay.batches import Claim, ClaimedEvent, ClaimedKey, KeyOutcome
from outbox_kafka.relay.boundaries import Delivery, Message
from outbox_kafka.relay.checks import sendable
from outbox_kafka.relay.policy import COPY_NOT_SENT, BatchResults, Discard, RetryPolicy
from outbox_kafka.relay.verdicts import Problem, Verdict
from outbox_kafka.stored_headers import message_size

#: Longest reason a dead-letter copy carries in its ``outbox_error`` header (bytes).
_MAX_REASON_HEADER = 4096


@dataclass
class BatchPlan:
    """What to send for a claim, and what is already decided without sending."""

    #: Keys with nothing to send now, and their next state.
    idle_keys: list[KeyOutcome] = field(default_factory=list)
    #: Keys with events to send, each with its events that may go out in this batch.
    keys: list[tuple[ClaimedKey, list[ClaimedEvent]]] = field(default_factory=list)
    #: The events to send, in order, and their messages.
    events: list[ClaimedEvent] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    #: Problems found before sending; nothing after such an event of its key is sent.
    results: BatchResults = field(default_factory=BatchResults)
    #: Keys' first events discarded whatever the send brings: their copies go with it.
    discarded_first: list[Discard] = field(default_factory=list)


def idle_key_outcome(key: ClaimedKey) -> KeyOutcome:
    """The next state of a key with nothing to send now: empty, not due yet, or its
    events left out of the claim for its byte budget."""
    if key.withheld and not key.events:
        return KeyOutcome.unchanged(key)
    if key.events:
        wait = max(0.0, key.events[0].wait_seconds)
        return KeyOutcome(key.key, key.next_seq, wait, False, False)
    # Every event up to last_seq is done (none pending in the same snapshot), so
    # the key may leave the queue unless a writer has added one since; the record
    # checks that under lock.
    done = max(key.next_seq, (key.last_seq or 0) + 1)
    return KeyOutcome(key.key, done, 0.0, False, True)


def over_topic_limit(
    message: Message, message_limit: Callable[[str], int | None]
) -> Problem | None:
    """The message's problem if it is larger than its topic takes (where told)."""
    limit = message_limit(message.topic)
    if limit is None:
        return None
    size = message_size(message.key, message.value, message.headers)
    if size <= limit:
        return None
    return (
        Verdict.PERMANENT,
        f"MSG_SIZE_TOO_LARGE: message is {size} bytes, over topic {message.topic!r}'s "
        f"max.message.bytes ({limit}); raise it, then requeue the event",
    )


def plan_batch(
    claim: Claim,
    problems: dict[int, Problem],
    topic_problem: Callable[[str], Problem | None],
    policy: RetryPolicy,
    message_limit: Callable[[str], int | None] = lambda topic: None,
) -> BatchPlan:
    """Each key's sendable events up to its first problem (a failed check from
    ``problems``, its topic's from ``topic_problem``, or a message larger than
    ``message_limit`` says its topic takes)."""
    plan = BatchPlan()
    for claimed in claim.keys:
        due = sendable(claimed)
        if not due:
            plan.idle_keys.append(idle_key_outcome(claimed))
            continue
        plan.keys.append((claimed, due))
        key = claimed.key.encode()
        for event in due:
            message = Message(event.topic, key, event.value, event.headers or [], event.event_id)
            problem = (
                problems.get(id(event))
                or topic_problem(event.topic)
                or over_topic_limit(message, message_limit)
            )
            if problem is not None:
                # Nothing later of this key goes out in this batch: whatever becomes
                # of this event (retry, park, discard), it is settled before anything
                # behind it is sent.
                plan.results.problems[id(event)] = problem
                verdict, error = problem
                if event is due[0] and policy.gives_up(event, verdict):
                    # Nothing of its key comes before it in this batch: it is
                    # discarded whatever the send brings, so its copy goes with
                    # the send. Behind earlier events of its key, it is discarded
                    # only if they all reach Kafka: decided after.
                    reason = policy.discard_reason(event, verdict, error)
                    plan.discarded_first.append(Discard(event, event.attempts + 1, reason, error))
                break
            plan.events.append(event)
            plan.messages.append(message)
    return plan


def dead_letter_messages(
    discards: list[Discard],
    topic: str | None,
    topic_problem: Callable[[str], Problem | None],
    copies: dict[int, tuple[Verdict, str | None]],
    message_limit: Callable[[str], int | None] = lambda topic: None,
) -> list[Message]:
    """The dead-letter copies of ``discards`` to send; where none can be sent (no
    dead-letter topic, a problem with it, a copy larger than it takes), the copy's
    verdict goes in ``copies``."""
    if not discards:
        return []
    if topic is None:
        copies.update((id(d.event), (Verdict.DELIVERED, None)) for d in discards)
        return []
    problem = topic_problem(topic)
    if problem is not None:
        verdict, error = problem
        if verdict == Verdict.HELD:
            verdict = Verdict.RETRIABLE  # the copy is made once the topic can take it
        copies.update((id(d.event), (verdict, error)) for d in discards)
        return []
    made = [(d, _copy(d, topic)) for d in discards]
    for discard, copy in made:
        too_large = over_topic_limit(copy, message_limit)
        if too_large is not None:
            copies[id(discard.event)] = too_large
    return [copy for discard, copy in made if id(discard.event) not in copies]


def _copy(discard: Discard, topic: str) -> Message:
    """The dead-letter copy of a discarded event: as it was, with why and where from."""
    d = discard
    return Message(
        topic,
        d.event.key.encode(),
        d.event.value,
        [
            *(d.event.headers or []),
            ("outbox_error", d.reason.encode("utf-8", "replace")[:_MAX_REASON_HEADER]),
            ("outbox_original_topic", d.event.topic.encode()),
            ("outbox_event_id", d.event.event_id.encode()),
        ],
        d.event.event_id,
    )


def note_copies(
    discards: list[Discard],
    deliveries: list[Delivery],
    copies: dict[int, tuple[Verdict, str | None]],
) -> None:
    """Record in ``copies`` how the dead-letter copies of ``discards`` fared, where
    they were sent (``deliveries`` is empty where no copy was made)."""
    for discard, delivery in zip(discards, deliveries, strict=False):
        if not delivery.sent:
            copies[id(discard.event)] = COPY_NOT_SENT
        elif not delivery.reported:
            copies[id(discard.event)] = (
                Verdict.RETRIABLE,
                "no delivery report for the dead-letter copy",
            )
        elif delivery.verdict in (Verdict.HELD, Verdict.BATCH_REJECTED, Verdict.RESET):
            # Not the copy's own fault: it is made again with the event's next try.
            copies[id(discard.event)] = (Verdict.RETRIABLE, delivery.error)
        else:
            copies[id(discard.event)] = (delivery.verdict, delivery.error)
