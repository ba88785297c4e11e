"""What the relay reports of its work: per cycle, after a drain, and what is left."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

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
