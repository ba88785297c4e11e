"""What a batch is at each stage, and what the relay reports of its work.

What a claim hands the relay (keys and their events), what the relay hands back to
be recorded (each key's and each event's next state), and the closed sets it decides
with: what became of a message (:class:`Verdict`) and an event's status. Then what
it reports: per cycle (:class:`CycleReport`), after a drain (:class:`DrainResult`),
and what is left pending and why (:class:`Remaining`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any, NamedTuple


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
    #: The relay sessions that may have sent events of the key that are not recorded
    #: (a claim that ended without a record, an outcome that may have been
    #: delivered): Kafka is read back from their floors before the key is sent.
    doubt: tuple[str, ...] = ()

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
    #: The relay session the claim was made in: the one that sends it (None: unknown).
    session: uuid.UUID | None = None

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


class Floor(NamedTuple):
    """Where a relay session's messages on one partition begin, as far as they may
    be unrecorded: no message of the session on the partition that is not recorded
    lies below ``offset``."""

    session: str
    topic: str
    partition: int
    #: The topic's partition count the session produced under.
    partitions: int
    offset: int


@dataclass(frozen=True)
class Doubts:
    """What a batch leaves known about Kafka beyond its acknowledgements: recorded
    with its outcome, in the same statement."""

    #: The session the batch was sent in.
    session: uuid.UUID
    #: By key: the last sequence number of a key with an event that may have reached
    #: Kafka without an acknowledgement. The session joins the key's doubt up to it.
    doubtful: dict[str, int] = field(default_factory=dict)
    #: By (topic, partition): the offset just past the batch's last acknowledged
    #: message there, which the session's floor is raised to when the batch still
    #: owns every key.
    floors: dict[tuple[str, int], int] = field(default_factory=dict)


@dataclass(frozen=True)
class RecordResult:
    """What recording a batch changed, as the database counted it."""

    keys_owned: int
    keys_removed: int
    delivered: int
    discarded: int
    retried: int
    latencies: list[float]


@dataclass
class ReadBackReport:
    """What one read-back did, for the relay's observers."""

    #: Keys in doubt in the claim.
    keys: int = 0
    #: Partitions read.
    partitions: int = 0
    #: Messages read.
    read: int = 0
    #: Events and dead-letter copies found on Kafka: recorded, not sent again.
    matched: int = 0
    #: Keys left in doubt and unsent: what is on Kafka could not be proven.
    unproven: int = 0
    #: Keys sent although unproven (the relay prefers at least once to waiting).
    resent_unproven: int = 0
    #: Events of the keys read back that are proven not on Kafka: sent now.
    absent: int = 0
    #: Why the first unproven key could not be proven.
    why_unproven: str | None = None
    #: Keys sent again without a read-back: a topic of theirs is compacted, where
    #: what is missing proves nothing (at least once for them).
    compacted: int = 0
    seconds: float = 0.0


#: The most reasons of held events :class:`Remaining` names.
HELD_REASONS_SHOWN = 3


@dataclass(frozen=True)
class Remaining:
    """Pending events, by why they are not being sent right now.

    ``held`` is a part of ``delayed``: a reader that does not tell held events
    apart still counts every pending event once.
    """

    pending: int
    #: On keys a relay holds a lease on.
    leased: int
    #: On parked keys.
    parked: int
    #: On keys waiting for a retry's backoff.
    retrying: int
    #: On keys waiting for a delayed event (``available_at``).
    delayed: int
    #: On keys due now.
    due: int
    #: Not reachable by the key queue: a consistency violation.
    unreachable: int
    #: Seconds until the first key that is not parked comes due; None: none will.
    next_due_seconds: float | None
    #: Of ``delayed``: on keys held until an operator acts (their next event's
    #: topic is missing, or access to it is not granted): that event has no
    #: attempt counted and its reason in ``last_error``. Looked at again every
    #: few seconds, never discarded.
    held: int = 0
    #: How many different reasons hold keys (``held_reasons`` names the first few).
    held_reason_count: int = 0
    #: The held events' reasons, the one holding the most keys first (at most
    #: :data:`HELD_REASONS_SHOWN`).
    held_reasons: tuple[str, ...] = ()

    @classmethod
    def from_row(cls, row: Any) -> Remaining:
        """From the row of the ``remaining_work`` statement."""
        return cls(
            pending=int(row.pending),
            leased=int(row.leased),
            parked=int(row.parked),
            retrying=int(row.retrying),
            delayed=int(row.delayed),
            due=int(row.due),
            unreachable=int(row.unreachable),
            next_due_seconds=None if row.next_due_seconds is None else float(row.next_due_seconds),
            held=int(row.held),
            held_reason_count=int(row.held_reason_count),
            held_reasons=tuple(row.held_reasons or ())[:HELD_REASONS_SHOWN],
        )

    def held_summary(self) -> str:
        """The held events and why, for people: ``"9 held: UNKNOWN_TOPIC: …"``."""
        if not self.held:
            return ""
        shown = " | ".join(self.held_reasons)
        others = self.held_reason_count - len(self.held_reasons)
        if others > 0:
            shown += f" | and {others} other reason{'s' if others != 1 else ''}"
        return f"{self.held} held: {shown}" if shown else f"{self.held} held"


@dataclass
class CycleReport:
    """What one cycle did; ``drain()`` sums these."""

    keys: int = 0
    keys_removed: int = 0
    sent: int = 0
    delivered: int = 0
    #: Events left pending after their send: to be retried, or held for an operator.
    retried: int = 0
    discarded: int = 0
    leases_lost: int = 0

    @property
    def progressed(self) -> bool:
        """Whether the cycle changed anything: sent or set aside events, or cleared empty keys.

        A claim can come back with only keys whose events are all done (they
        leave the queue in that cycle) while keys with work wait behind them;
        the next cycle should then follow at once.
        """
        return self.sent > 0 or self.keys_removed > 0 or self.discarded > 0

    def add(self, other: CycleReport) -> None:
        """Add ``other``'s counts to this report."""
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def since(self, earlier: CycleReport) -> CycleReport:
        """What was counted after ``earlier``, a copy of this running report taken then."""
        return CycleReport(
            **{f.name: getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)}
        )


@dataclass(frozen=True)
class DrainResult:
    """What :meth:`Relay.drain_all` did, and what it left pending and why."""

    report: CycleReport
    #: What is left; None when it could not be read (``error`` says why).
    left: Remaining | None
    #: Why what is left could not be read; or, with ``left``, what else went wrong.
    error: str | None = None

    @property
    def complete(self) -> bool:
        """Nothing is left pending."""
        return self.left is not None and self.left.pending == 0

    def summary(self) -> str:
        """One line for people: what was sent, and what is left and why."""
        r, left = self.report, self.left
        line = (
            f"drained: {r.delivered} delivered, {r.discarded} discarded, "
            f"{r.retried} retried or held, {r.leases_lost} leases lost"
        )
        if left is None:
            return f"{line}; could not read what is left pending: {self.error}"
        if self.error is not None:
            line = f"{line}; {self.error}"
        if self.complete:
            return line + "; nothing left pending"
        reasons = [
            (left.leased, "on keys another relay still holds a lease on"),
            (left.parked, "on parked keys (outbox-kafka requeue or unpark)"),
            (left.retrying, "waiting for a retry"),
            (left.delayed - left.held, "delayed (available_at)"),
            (left.due, "due now (written during the drain)"),
            (left.unreachable, "unreachable by the key queue (outbox-kafka check --consistency)"),
        ]
        why = ", ".join(
            ([left.held_summary()] if left.held else [])
            + [f"{n} {what}" for n, what in reasons if n]
        )
        when = (
            ""
            if left.next_due_seconds is None
            else f"; the next key comes due in {max(0.0, left.next_due_seconds):.1f} s"
        )
        return f"{line}; left pending: {left.pending} ({why}){when}"
