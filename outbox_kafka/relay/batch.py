"""What a claim hands the relay (keys and their events), what the relay hands back to
be recorded (each key's and each event's next state), and the closed sets it decides
with: what became of a message (:class:`Verdict`) and an event's status."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from enum import StrEnum
from typing import NamedTuple


class Verdict(StrEnum):
    """What became of one message handed to Kafka (or meant for it) in a batch."""

    #: Kafka acknowledged it.
    DELIVERED = "delivered"
    #: It failed in a way a later attempt may not: retried after a backoff.
    RETRIABLE = "retriable"
    #: It failed in a way no retry can fix: set aside at once.
    PERMANENT = "permanent"
    #: It cannot go out until an operator fixes something outside it (its topic
    #: is missing, access to it is not granted): its key waits, in order, and is
    #: tried again every few seconds; no attempt is counted, nothing is discarded.
    HELD = "held"
    #: The broker refused the whole record batch it went in: whether the message
    #: itself is at fault is known only once it is sent alone.
    BATCH_REJECTED = "batch_rejected"
    #: The producer's session with the broker ended under it (fenced, its epoch or
    #: sequence numbers lost): the message is not at fault. The producer is rebuilt
    #: and the event tried again after a short backoff; no attempt is counted.
    RESET = "reset"
    #: It never reached the producer (not sent: lease too short, shutdown, earlier failure).
    UNSENT = "unsent"
    #: The producer took it, but no delivery report came before the wait ended.
    UNREPORTED = "unreported"


class EventStatus(StrEnum):
    """An event row's status, as the outbox table stores it."""

    PENDING = "pending"
    DELIVERED = "delivered"
    DISCARDED = "discarded"


#: A verdict and its reason: what a check or a send found wrong with one message.
Problem = tuple[Verdict, str]


class ClaimedEvent(NamedTuple):
    event_id: str
    key: str
    seq: int
    topic: str
    type: str
    value: bytes
    headers: list[tuple[str, bytes]] | None  # None: the stored headers are malformed
    attempts: int
    due: bool
    wait_seconds: float
    #: ``value`` as text when it came as UTF-8 text (the common case), for the envelope check.
    text: str | None = None


@dataclass
class ClaimedKey:
    key: str
    next_seq: int
    events: list[ClaimedEvent] = field(default_factory=list)
    #: The last sequence number handed out for the key at claim time (None: unknown).
    last_seq: int | None = None
    #: Events of the key were left out of the claim to keep it within its byte budget.
    withheld: bool = False
    #: When the key was due before the claim leased it, in the store's clock (seconds):
    #: its place in the queue. None: unknown.
    due_at: float | None = None

    @property
    def waiting(self) -> int:
        """How many events the key had from ``next_seq`` on: at least those claimed."""
        return len(self.events) + self.waiting_beyond_claim

    @property
    def waiting_beyond_claim(self) -> int:
        """Sequence numbers handed out from ``next_seq`` on that the claim did not bring.

        Unknown (``last_seq`` None) counts as one. Sequence numbers of events
        that are not pending, or not committed yet, count too.
        """
        if self.last_seq is None:
            return 1
        return max(0, self.last_seq - self.next_seq + 1 - len(self.events))


@dataclass(frozen=True)
class Claim:
    token: uuid.UUID
    keys: list[ClaimedKey]
    per_key_limit: int

    @property
    def event_count(self) -> int:
        return sum(len(k.events) for k in self.keys)


class KeyOutcome(NamedTuple):
    """A key's state after its batch: where it resumes, when, and whether it is done."""

    key: str
    #: The first sequence number not yet settled: the key's next event to send.
    next_seq: int
    #: Seconds before the key is due again.
    delay: float
    #: The key stops at ``next_seq`` until an operator requeues or unparks it.
    park: bool
    #: Every event of the key up to the last one handed out is settled: the key may
    #: leave the queue (the record checks, under lock, that no writer added one since).
    drained: bool
    #: When set, the key is due at this time (the store's clock, as in
    #: :attr:`ClaimedKey.due_at`) instead of ``delay`` seconds after the record.
    due_at: float | None = None

    @classmethod
    def unchanged(cls, key: ClaimedKey) -> KeyOutcome:
        """The key handed back as it was claimed: due when it was due before the claim,
        so it keeps its place in the queue (at once when that is not known)."""
        return cls(key.key, key.next_seq, 0.0, False, False, key.due_at)


class EventOutcome(NamedTuple):
    """An event's state after its batch."""

    event_id: str
    key: str
    status: EventStatus
    #: Attempts this batch adds to the event's count (0 or 1).
    attempts_added: int
    #: Seconds before the event may be sent again (a retry's backoff).
    delay: float
    partition: int | None
    offset: int | None
    error: str | None


@dataclass(frozen=True)
class RecordResult:
    """What recording a batch changed, as the database counted it."""

    keys_owned: int
    keys_removed: int
    delivered: int
    discarded: int
    retried: int
    latencies: list[float]
