"""The retry policy: what becomes of each event of a key after a send.

Pure decisions: :meth:`RetryPolicy.settle` walks one key's events with what the
batch brought (the checks' problems, the delivery reports, the dead-letter
copies) and returns the key's and its events' next state, with the retries,
discards and order violations it decided, for the loop to record, log and count.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from outbox_kafka.relay.batches import ClaimedEvent, ClaimedKey, EventOutcome, KeyOutcome
from outbox_kafka.relay.boundaries import Delivery
from outbox_kafka.relay.settings import RelaySettings
from outbox_kafka.relay.verdicts import EventStatus, Problem, Verdict

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
        copy_unknown: Problem | tuple[Verdict, None] = COPY_NOT_SENT,
        rehearsal: bool = False,
    ) -> Settlement:
        """Walk one key's events in sequence order and decide what happens next.

        Delivered events are recorded as delivered whatever happened before
        them (that is the truth in Kafka). The first event that failed
        retriably holds the key: it is retried after a backoff and nothing
        after it is sent until it succeeds or is discarded. A discarded event
        whose dead-letter copy failed retriably is kept and retried too.
        ``copy_unknown`` is the verdict of a copy the batch has no answer for; a
        ``rehearsal`` draws no backoff (its delays are 0).
        """
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
                out.append(
                    EventOutcome(
                        event.event_id,
                        key.key,
                        EventStatus.DELIVERED,
                        0,
                        0.0,
                        delivery.partition,
                        delivery.offset,
                        None,
                    )
                )
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
            copy_verdict, copy_error = results.copies.get(id(event), copy_unknown)
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
            settled.decisions.append(Discard(event, attempt, reason, error, failed))
            if self.park:
                held_back = held_back or event
                blocked = parked = True
                next_seq = event.seq
        # Every claimed event was due, and the key had nothing more visible when
        # claimed: fewer events than asked for, or all it had been handed out.
        drained = (
            not key.withheld
            and len(due) == len(key.events)
            and (len(key.events) < per_key_limit or key.waiting_beyond_claim == 0)
        )
        if in_producer:
            delay = max(delay, self.lease_seconds)
        if next_seq == key.next_seq and not settled.events and not delay and not parked:
            # Nothing of the key was sent or settled (the send was skipped): it is
            # handed back as claimed and keeps its place in the queue.
            settled.key = KeyOutcome.unchanged(key)
            return settled
        settled.key = KeyOutcome(
            key.key, next_seq, delay, parked, drained and not blocked and not parked
        )
        return settled

    def discards(
        self, key: ClaimedKey, due: list[ClaimedEvent], results: BatchResults, per_key_limit: int
    ) -> list[Discard]:
        """The events of one key that :meth:`settle` discards if every dead-letter copy
        not yet answered succeeds: the ones whose copies to send. A failed copy holds
        the key at its event, so a later one may have been copied in vain: copies are
        at least once."""
        assumed = self.settle(
            key,
            due,
            results,
            per_key_limit,
            copy_unknown=(Verdict.DELIVERED, None),
            rehearsal=True,
        )
        return assumed.discards

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
