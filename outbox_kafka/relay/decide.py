"""The relay's decisions, as pure functions of what a batch brought: which of a key's
events go out together (:func:`sendable`), a batch's plan (:func:`plan_batch`: the
messages, and the dead-letter copies known before sending), and the retry policy
(:meth:`RetryPolicy.settle`: each key's and event's next state, with the retries,
holds, discards and order violations it decided, and the dead-letter copies still
to send). The loop applies them: :mod:`~outbox_kafka.relay.send` sends, logs and
counts; the store records.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

from outbox_kafka.relay.batch import (
    Claim,
    ClaimedEvent,
    ClaimedKey,
    EventOutcome,
    EventStatus,
    KeyOutcome,
    Problem,
    Verdict,
)
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.lease import in_flight_hold
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.stored_headers import message_size


def sendable(key: ClaimedKey) -> list[ClaimedEvent]:
    """The key's claimed events that may go out in this batch: the due ones, in order,
    up to the first for another topic than the first's.

    Kafka orders messages within a partition only, so an event for another topic
    could land while an earlier one of its key is still unacknowledged and then
    fails. It goes in a later batch, once everything before it is recorded.
    """
    run: list[ClaimedEvent] = []
    for event in key.events:
        if not event.due or event.topic != key.events[0].topic:
            break
        run.append(event)
    return run


#: The longest wait before a held key is looked at again (jittered, at most the backoff cap).
HOLD_SECONDS = 5.0

#: A dead-letter copy that did not go out in this batch: the event is retried later.
COPY_NOT_SENT: Problem = (Verdict.RETRIABLE, "the dead-letter copy was not sent in this batch")


def backoff_delay(attempt: int, base: float, cap: float, rng: random.Random) -> float:
    """Exponential backoff with jitter: uniform in [d/2, d], d = min(cap, base * 2**(attempt-1))."""
    ceiling: float = min(cap, base * 2.0 ** max(0, min(attempt - 1, 62)))
    return ceiling / 2 + rng.random() * ceiling / 2


def error_label(error: str | None) -> str:
    """A low-cardinality label for an error message: its leading error name."""
    if not error:
        return "unknown"
    head = error.split(":", 1)[0].strip()
    return head if head.replace("_", "").isalnum() and len(head) <= 40 else "other"


@dataclass
class BatchResults:
    """What a batch found out about its events, each looked up by ``id(event)``."""

    #: Problems found before or instead of sending (checks, topic lookups).
    problems: dict[int, Problem] = field(default_factory=dict)
    #: What the producer reported of each event handed to it.
    deliveries: dict[int, Delivery] = field(default_factory=dict)
    #: (verdict, error) of each discarded event's dead-letter copy.
    copies: dict[int, tuple[Verdict, str | None]] = field(default_factory=dict)

    def verdict_of(self, event: ClaimedEvent) -> tuple[Verdict, str | None]:
        problem = self.problems.get(id(event))
        if problem is not None:
            return problem
        delivery = self.deliveries.get(id(event))
        if delivery is None or not delivery.sent:
            return Verdict.UNSENT, None
        if not delivery.reported:
            return Verdict.UNREPORTED, delivery.error
        return delivery.verdict, delivery.error


@dataclass(frozen=True)
class Retry:
    event: ClaimedEvent
    attempt: int
    error: str | None
    #: The event itself is to be discarded, but its dead-letter copy failed (``error``).
    copy_failed: bool = False
    #: Whether the failure counts as an attempt (not when the producer was reset:
    #: ``attempt`` is then the count the event already had).
    counted: bool = True


@dataclass(frozen=True)
class Discard:
    event: ClaimedEvent
    attempt: int
    #: Why, as recorded on the row.
    reason: str
    #: The failure that led to it (its label counts the discard).
    error: str | None
    #: Whether the dead-letter copy failed (its verdict and error), if it did.
    copy_failed: tuple[Verdict, str | None] | None = None


@dataclass(frozen=True)
class Hold:
    """An event that waits for an operator (its topic is missing, access is not
    granted): its key stops at it, no attempt is counted, and it is tried again."""

    event: ClaimedEvent
    error: str | None


@dataclass(frozen=True)
class OrderViolation:
    """A later event of a key that Kafka took while an earlier one did not get there."""

    earlier: ClaimedEvent
    later: ClaimedEvent


Decision = Retry | Discard | Hold | OrderViolation


@dataclass
class Settlement:
    """One key's decisions after its batch."""

    key: KeyOutcome
    events: list[EventOutcome] = field(default_factory=list)
    delivered: list[ClaimedEvent] = field(default_factory=list)
    #: Retries, discards and order violations, in the key's sequence order.
    decisions: list[Decision] = field(default_factory=list)
    #: Discards whose dead-letter copies the batch has yet to send. The walk assumed
    #: they go out; until their answers are in, this settlement is provisional.
    copies_to_send: list[Discard] = field(default_factory=list)

    @property
    def retries(self) -> list[Retry]:
        return [d for d in self.decisions if isinstance(d, Retry) and not d.copy_failed]

    @property
    def copy_retries(self) -> list[Retry]:
        """Retries held back by a dead-letter copy that failed (with the copy's error)."""
        return [d for d in self.decisions if isinstance(d, Retry) and d.copy_failed]

    @property
    def discards(self) -> list[Discard]:
        return [d for d in self.decisions if isinstance(d, Discard)]

    @property
    def order_violations(self) -> list[OrderViolation]:
        return [d for d in self.decisions if isinstance(d, OrderViolation)]


@dataclass
class RetryPolicy:
    """Retry with backoff up to ``max_attempts``; then discard (with a dead-letter copy)
    and go on with the key, or discard and park the key."""

    max_attempts: int
    park: bool
    backoff_base: float
    backoff_cap: float
    #: How long a key whose event is still inside the producer stays off limits.
    lease_seconds: float
    rng: random.Random = field(default_factory=random.Random)

    @classmethod
    def from_settings(cls, settings: RelaySettings) -> RetryPolicy:
        return cls(
            max_attempts=settings.max_attempts,
            park=settings.on_exhausted == "park",
            backoff_base=settings.backoff_base,
            backoff_cap=settings.backoff_cap,
            lease_seconds=settings.lease_seconds,
        )

    def gives_up(self, event: ClaimedEvent, verdict: Verdict) -> bool:
        """Whether an event that failed with ``verdict`` this time is discarded (or parked)."""
        return verdict == Verdict.PERMANENT or event.attempts + 1 >= self.max_attempts

    def discard_reason(self, event: ClaimedEvent, verdict: Verdict, error: str | None) -> str:
        """Why an event is discarded: its error, or the attempts it was given."""
        if verdict == Verdict.PERMANENT:
            return error or "unknown error"
        return f"gave up after {event.attempts + 1} attempts: {error}"

    def backoff(self, attempt: int) -> float:
        return backoff_delay(attempt, self.backoff_base, self.backoff_cap, self.rng)

    def settle(
        self,
        key: ClaimedKey,
        due: list[ClaimedEvent],
        results: BatchResults,
        per_key_limit: int,
        *,
        copy_unknown: Problem | tuple[Verdict, None] | None = COPY_NOT_SENT,
    ) -> Settlement:
        """Walk one key's events in sequence order and decide what happens next.

        Delivered events are recorded as delivered whatever happened before
        them (that is the truth in Kafka). The first event that failed
        retriably holds the key: it is retried after a backoff and nothing
        after it is sent until it succeeds or is discarded. A discarded event
        whose dead-letter copy failed retriably is kept and retried too.
        ``copy_unknown`` is the verdict of a copy the batch has no answer for.

        The same walk decides which dead-letter copies the batch still has to
        send: with ``copy_unknown=None``, a discarded event whose copy has no
        answer yet is listed in :attr:`Settlement.copies_to_send` and its copy
        assumed to go out, so that the walk goes on to the key's later discards
        (a failed copy holds the key at its event, so a later one may have been
        copied in vain: copies are at least once). Such a settlement is
        provisional, and draws no backoff past that point: once the copies'
        answers are in ``results.copies``, the key is settled again.
        """
        acknowledged = _all_acknowledged(key, due, results, per_key_limit)
        if acknowledged is not None:
            return acknowledged
        #: A copy's answer was assumed: what follows is provisional (no backoff drawn).
        rehearsal = False
        next_seq = due[-1].seq + 1
        delay = 0.0
        parked = blocked = False
        #: An event is still inside the producer and may land yet: whatever else
        #: holds the key, it stays off limits for a lease, so that no copy of it,
        #: nor of an earlier event, is sent before that copy is delivered or dead.
        in_producer = False
        #: An earlier event of the key in this batch that did not reach Kafka and
        #: still should before anything after it (retry, unsent, parked).
        held_back: ClaimedEvent | None = None
        settled = Settlement(KeyOutcome(key.key, next_seq, 0.0, False, False))
        out = settled.events
        for event in due:
            verdict, error = results.verdict_of(event)
            if verdict == Verdict.DELIVERED:
                delivery = results.deliveries[id(event)]
                if held_back is not None:
                    settled.decisions.append(OrderViolation(held_back, event))
                out.append(delivered_outcome(event, key.key, delivery))
                settled.delivered.append(event)
                continue
            in_producer = in_producer or verdict == Verdict.UNREPORTED
            if blocked:
                continue
            if verdict in (Verdict.UNSENT, Verdict.UNREPORTED, Verdict.BATCH_REJECTED):
                # Not handed over, still inside the producer, or refused with its
                # batch and not sent alone yet: leave it pending, no attempt counted.
                held_back = held_back or event
                blocked, next_seq = True, event.seq
                continue
            if verdict == Verdict.HELD:
                settled.decisions.append(Hold(event, error))
                held_back = held_back or event
                blocked, next_seq = True, event.seq
                delay = self._hold(event, error, out, rehearsal)
                continue
            if verdict == Verdict.RESET:
                settled.decisions.append(Retry(event, event.attempts, error, counted=False))
                held_back = held_back or event
                blocked, next_seq = True, event.seq
                delay = self._retry_uncounted(event, out, rehearsal)
                continue
            attempt = event.attempts + 1
            if not self.gives_up(event, verdict):
                settled.decisions.append(Retry(event, attempt, error))
                held_back = held_back or event
                blocked, next_seq = True, event.seq
                delay = self._retry_later(event, error, out, rehearsal)
                continue
            reason = self.discard_reason(event, verdict, error)
            copy = results.copies.get(id(event))
            to_send = copy is None and copy_unknown is None
            if to_send:
                rehearsal = True
                copy = (Verdict.DELIVERED, None)
            elif copy is None:
                assert copy_unknown is not None
                copy = copy_unknown
            copy_verdict, copy_error = copy
            if copy_verdict == Verdict.RETRIABLE:
                # The dead-letter copy did not make it yet: keep the event, retry later.
                settled.decisions.append(Retry(event, attempt, copy_error, copy_failed=True))
                held_back = held_back or event
                blocked, next_seq = True, event.seq
                delay = self._retry_later(event, copy_error, out, rehearsal)
                continue
            failed = None if copy_verdict == Verdict.DELIVERED else (copy_verdict, copy_error)
            if copy_verdict == Verdict.PERMANENT:
                # No copy can ever be made (e.g. too large for the dead-letter topic too):
                # the row itself, discarded with its reason, is what remains.
                reason = f"{reason}; dead-letter copy impossible: {copy_error}"
            out.append(
                EventOutcome(
                    event.event_id, key.key, EventStatus.DISCARDED, 1, 0.0, None, None, reason
                )
            )
            discard = Discard(event, attempt, reason, error, failed)
            settled.decisions.append(discard)
            if to_send:
                settled.copies_to_send.append(discard)
            if self.park:
                held_back = held_back or event
                blocked = parked = True
                next_seq = event.seq
        drained = _drained(key, due, per_key_limit)
        if in_producer:
            delay = max(delay, in_flight_hold(self.lease_seconds))
        if next_seq == key.next_seq and not settled.events and not delay and not parked:
            # Nothing of the key was sent or settled (the send was skipped): it is
            # handed back as claimed and keeps its place in the queue.
            settled.key = KeyOutcome.unchanged(key)
            return settled
        settled.key = KeyOutcome(
            key.key, next_seq, delay, parked, drained and not blocked and not parked
        )
        return settled

    def _hold(
        self, event: ClaimedEvent, error: str | None, out: list[EventOutcome], rehearsal: bool
    ) -> float:
        """Keep a held event pending, its attempts as they were; the delay before the
        key is looked at again."""
        ceiling = min(self.backoff_cap, HOLD_SECONDS)
        delay = 0.0 if rehearsal else ceiling / 2 + self.rng.random() * ceiling / 2
        out.append(
            EventOutcome(
                event.event_id, event.key, EventStatus.PENDING, 0, delay, None, None, error
            )
        )
        return delay

    def _retry_uncounted(
        self, event: ClaimedEvent, out: list[EventOutcome], rehearsal: bool
    ) -> float:
        """Keep an event whose producer was reset pending, its attempts and last error
        as they were; the first attempt's backoff before it is sent again."""
        backoff = 0.0 if rehearsal else self.backoff(1)
        out.append(
            EventOutcome(
                event.event_id, event.key, EventStatus.PENDING, 0, backoff, None, None, None
            )
        )
        return backoff

    def _retry_later(
        self, event: ClaimedEvent, error: str | None, out: list[EventOutcome], rehearsal: bool
    ) -> float:
        """Record one more failed attempt and return the backoff before the next."""
        backoff = 0.0 if rehearsal else self.backoff(event.attempts + 1)
        out.append(
            EventOutcome(
                event.event_id, event.key, EventStatus.PENDING, 1, backoff, None, None, error
            )
        )
        return backoff


def delivered_outcome(event: ClaimedEvent, key: str, delivery: Delivery) -> EventOutcome:
    """An event Kafka acknowledged, where it landed: delivered, no attempt counted."""
    return EventOutcome(
        event.event_id,
        key,
        EventStatus.DELIVERED,
        0,
        0.0,
        delivery.partition,
        delivery.offset,
        None,
    )


def _drained(key: ClaimedKey, due: list[ClaimedEvent], per_key_limit: int) -> bool:
    """Whether every claimed event was due, and the key had nothing more visible when
    claimed: fewer events than asked for, or all it had been handed out."""
    return (
        not key.withheld
        and len(due) == len(key.events)
        and (len(key.events) < per_key_limit or key.waiting_beyond_claim == 0)
    )


def _all_acknowledged(
    key: ClaimedKey, due: list[ClaimedEvent], results: BatchResults, per_key_limit: int
) -> Settlement | None:
    """The settlement of a key whose every event in the batch Kafka acknowledged (most
    keys of most batches), as :meth:`RetryPolicy.settle` walks it, in one short pass;
    None when any of them was not."""
    deliveries = results.deliveries
    problems = results.problems
    name = key.key
    out: list[EventOutcome] = []
    for event in due:
        delivery = deliveries.get(id(event))
        if (
            delivery is None
            or delivery.verdict != Verdict.DELIVERED
            or not delivery.reported
            or not delivery.sent
            or id(event) in problems
        ):
            return None
        out.append(delivered_outcome(event, name, delivery))
    outcome = KeyOutcome(name, due[-1].seq + 1, 0.0, False, _drained(key, due, per_key_limit))
    return Settlement(outcome, out, list(due))


#: Longest reason a dead-letter copy carries in its ``outbox_error`` header (bytes).
_MAX_REASON_HEADER = 4096


@dataclass
class FoundOnKafka:
    """What reading Kafka back found for a claim's keys in doubt."""

    #: By event id: events found on Kafka, as delivered there.
    deliveries: dict[str, Delivery] = field(default_factory=dict)
    #: By event id: dead-letter copies found on Kafka.
    copies: dict[str, Delivery] = field(default_factory=dict)
    #: Keys that wait, unsent, and why: what is on Kafka could not be proven.
    unproven: dict[str, str] = field(default_factory=dict)
    #: Seconds before an unproven key is tried again.
    retry_seconds: float = 5.0


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
    #: Problems found before sending (nothing after such an event of its key is
    #: sent), and events found on Kafka already.
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


#: What to do about an event over its topic's limit, in the polling relay.
_REQUEUE = "raise it, then requeue the event"


def over_topic_limit(
    message: Message, message_limit: Callable[[str], int | None], remedy: str = _REQUEUE
) -> Problem | None:
    """The message's problem if it is larger than its topic takes (where told)."""
    limit = message_limit(message.topic)
    return None if limit is None else over_limit(message, limit, remedy)


def over_limit(message: Message, limit: int, remedy: str = _REQUEUE) -> Problem | None:
    """The message's problem if it is larger than ``limit``, its topic's
    ``max.message.bytes``; ``remedy`` says what to do."""
    size = message_size(message.key, message.value, message.headers)
    if size <= limit:
        return None
    return (
        Verdict.PERMANENT,
        f"MSG_SIZE_TOO_LARGE: message is {size} bytes, over topic {message.topic!r}'s "
        f"max.message.bytes ({limit}); {remedy}",
    )


def plan_batch(
    claim: Claim,
    problems: dict[int, Problem],
    topic_problem: Callable[[str], Problem | None],
    policy: RetryPolicy,
    message_limit: Callable[[str], int | None] = lambda topic: None,
    *,
    found: FoundOnKafka | None = None,
    partition_of: Callable[[str, bytes], int | None] | None = None,
) -> BatchPlan:
    """Each key's sendable events up to its first problem (a failed check from
    ``problems``, its topic's from ``topic_problem``, or a message larger than
    ``message_limit`` says its topic takes).

    ``found``: what reading Kafka back found for keys in doubt: events found there
    are delivered without a send (their dead-letter copies too), and keys whose
    read-back proved nothing wait. ``partition_of(topic, key)``: the partition each
    message goes to (None: the producer's partitioner chooses)."""
    plan = BatchPlan()
    #: By topic, asked once a batch: what stops every message to it, else its limit.
    topics: dict[str, tuple[Problem | None, int | None]] = {}
    for claimed in claim.keys:
        due = sendable(claimed)
        if found is not None and claimed.key in found.unproven:
            # What is on Kafka is not known yet: nothing of the key goes out.
            plan.idle_keys.append(
                KeyOutcome(claimed.key, claimed.next_seq, found.retry_seconds, False, False)
            )
            continue
        if not due:
            plan.idle_keys.append(idle_key_outcome(claimed))
            continue
        plan.keys.append((claimed, due))
        key = claimed.key.encode()
        topic = due[0].topic  # every event of the run goes to it (sendable)
        partition = None if partition_of is None else partition_of(topic, key)
        asked = topics.get(topic)
        for event in due:
            if found is not None:
                copy = found.copies.get(event.event_id)
                if copy is not None:
                    plan.results.copies[id(event)] = (Verdict.DELIVERED, None)
                delivery = found.deliveries.get(event.event_id)
                if delivery is not None:
                    plan.results.deliveries[id(event)] = delivery
                    continue
            message = Message(
                event.topic, key, event.value, event.headers or [], event.event_id, partition
            )
            problem = problems.get(id(event))
            if problem is None:
                if asked is None:
                    trouble = topic_problem(topic)
                    asked = topics[topic] = (trouble, None if trouble else message_limit(topic))
                trouble, limit = asked
                problem = trouble or (None if limit is None else over_limit(message, limit))
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
    """The dead-letter copy of a discarded event."""
    e = discard.event
    return dead_letter_copy(topic, e.event_id, e.key, e.topic, e.value, e.headers, discard.reason)


def dead_letter_copy(
    topic: str,
    event_id: str,
    key: str,
    original_topic: str,
    value: bytes,
    headers: list[tuple[str, bytes]] | None,
    reason: str,
) -> Message:
    """The dead-letter copy of an event set aside: as it was, with why and where from."""
    return Message(
        topic,
        key.encode(),
        value,
        [
            *(headers or []),
            ("outbox_error", reason.encode("utf-8", "replace")[:_MAX_REASON_HEADER]),
            ("outbox_original_topic", original_topic.encode()),
            ("outbox_event_id", event_id.encode()),
        ],
        event_id,
    )


def note_copies(
    discards: list[Discard],
    sent: list[Message],
    deliveries: list[Delivery],
    copies: dict[int, tuple[Verdict, str | None]],
) -> None:
    """Record in ``copies`` how the dead-letter copies ``sent`` of ``discards`` fared
    (``deliveries``, one per copy sent). A discard whose copy was not made (too large
    for its topic, no topic) has its verdict in ``copies`` already."""
    answers = {m.event_id: d for m, d in zip(sent, deliveries, strict=True)}
    for discard in discards:
        delivery = answers.get(discard.event.event_id)
        if delivery is None:
            continue
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
