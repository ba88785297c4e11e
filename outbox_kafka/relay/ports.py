"""The relay's ports, as Protocols: the store (the outbox tables), the publisher
(Kafka), with the messages and delivery reports that cross it, and the reader that
reads Kafka back for keys in doubt. :mod:`outbox_kafka.testing` has an in-memory
fake of each."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple, Protocol

from outbox_kafka.relay.batch import Problem, Verdict

if TYPE_CHECKING:
    import uuid

    from outbox_kafka.relay.batch import (
        Claim,
        Doubts,
        EventOutcome,
        Floor,
        KeyOutcome,
        RecordResult,
        Remaining,
    )
    from outbox_kafka.relay.wake import Wakeups


class Message(NamedTuple):
    """One message to send, as stored by the producer side."""

    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    #: The event's id (text form), for traces; empty when not known.
    event_id: str = ""
    #: The partition to send it to; None: the producer's partitioner chooses.
    partition: int | None = None


@dataclass(slots=True)
class Delivery:
    """What became of one message handed to the publisher."""

    verdict: Verdict = Verdict.RETRIABLE
    partition: int | None = None
    offset: int | None = None
    error: str | None = None
    #: The producer took the message.
    sent: bool = False
    #: A delivery report came for it.
    reported: bool = False
    #: The error left the producer unusable (it is rebuilt before the next send).
    fatal: bool = False
    #: The error reported does not prove that the broker did not append the message
    #: (a timeout, a lost connection): it may be on Kafka.
    may_have_landed: bool = False

    @property
    def in_doubt(self) -> bool:
        """The producer took the message and it may be on Kafka, unacknowledged."""
        return (
            self.sent
            and self.verdict != Verdict.DELIVERED
            and (not self.reported or self.may_have_landed)
        )


class ClaimStore(Protocol):
    """Where the relay claims events and records what became of them."""

    url_for_logs: str
    #: Whether the last claim left producers' arrivals behind (go again at once).
    arrivals_left: bool

    def claim(
        self,
        *,
        batch_size: int,
        lease_seconds: float,
        max_keys: int | None,
        max_bytes: int,
        session: uuid.UUID | None = None,
    ) -> Claim: ...

    def record(
        self,
        token: uuid.UUID,
        keys: Sequence[KeyOutcome],
        events: Sequence[EventOutcome],
        doubts: Doubts | None = None,
    ) -> RecordResult: ...

    def open_floors(self, session: uuid.UUID, floors: Sequence[Floor]) -> None:
        """Write the session's floors on partitions new to it; committed on return."""
        ...

    def read_floors(self, sessions: Sequence[str], topics: Sequence[str]) -> list[Floor]:
        """The floors of ``sessions`` on ``topics``."""
        ...

    def forget_floors(self, older_seconds: float) -> None:
        """Delete the floors of sessions older than ``older_seconds`` that no key names."""
        ...

    def remaining(self) -> Remaining: ...

    def purge(self, *, delivered_seconds: float, discarded_seconds: float, batch: int) -> int: ...

    def wakeups(self) -> Wakeups | None:
        """The LISTEN/NOTIFY connection of this store; None: the relay polls."""
        ...

    def close(self) -> None: ...


class MessagePublisher(Protocol):
    """Where the relay sends messages."""

    max_message_bytes: int

    def topic_problem(self, topic: str) -> Problem | None:
        """Why messages to ``topic`` cannot be sent now, if they cannot."""
        ...

    def message_limit(self, topic: str) -> int | None:
        """The largest message ``topic`` takes, where the broker tells it; else None."""
        ...

    def partition_count(self, topic: str) -> int | None:
        """How many partitions ``topic`` has, as last read (None: not known)."""
        ...

    def send(
        self, messages: Sequence[Message], *, timeout: float, abort: Callable[[], bool]
    ) -> list[Delivery]:
        """Send ``messages`` and wait for their reports; one Delivery per message, in order."""
        ...

    def poll(self) -> None:
        """Serve callbacks (statistics, logs) while idle."""
        ...

    def broker_problem(self, timeout: float) -> str | None:
        """Why no broker answers within ``timeout`` seconds, or None (for readiness)."""
        ...

    def close(self, timeout: float) -> None: ...


class Found(NamedTuple):
    """A message read back from Kafka: where it is and what it holds."""

    topic: str
    partition: int
    offset: int
    key: bytes
    value: bytes
    #: In the message's order; a header with a null value reads as ``b""``.
    headers: list[tuple[str, bytes]]


@dataclass
class ReadBack:
    """What a read-back read.

    Every (topic, partition) asked for ends up in exactly one of ``complete`` and
    ``unproven``.
    """

    #: The messages of the keys asked for, in each partition's offset order, from the
    #: partition's start offset on (partitions one after another, in no set order).
    found: list[Found] = field(default_factory=list)
    #: Messages read in all (of any key).
    read: int = 0
    #: Partitions read from their start to their end: every message of the keys asked
    #: for that was on the partition between the start and ``ends`` is in ``found``.
    complete: set[tuple[str, int]] = field(default_factory=set)
    #: Partitions not read to their end, with the reason: nothing is proven about
    #: their messages not in ``found``.
    unproven: dict[tuple[str, int], str] = field(default_factory=dict)
    #: For each complete partition: the offset its end was last seen at (the end of
    #: the log then; ``found`` covers at least up to it).
    ends: dict[tuple[str, int], int] = field(default_factory=dict)


class KafkaReader(Protocol):
    """Where the relay reads back what reached Kafka, for keys in doubt."""

    def end_offsets(self, topic: str, partitions: Sequence[int], timeout: float) -> dict[int, int]:
        """Each partition's end offset now (never past the true end)."""
        ...

    def read(
        self, starts: Mapping[tuple[str, int], int], keys: Collection[bytes], deadline: float
    ) -> ReadBack:
        """The messages of ``keys`` from each (topic, partition)'s start to its end,
        read until ``deadline`` (``time.monotonic()``)."""
        ...

    def compacted(self, topic: str, timeout: float) -> bool | None:
        """Whether ``topic`` is compacted; None when the broker does not say."""
        ...

    def close(self) -> None: ...
