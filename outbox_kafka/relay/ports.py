"""The relay's two ports, as Protocols: the store (the outbox tables) and the publisher
(Kafka), with the messages and delivery reports that cross the second.
:mod:`outbox_kafka.testing` has an in-memory fake of each."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple, Protocol

from outbox_kafka.relay.batch import Problem, Verdict

if TYPE_CHECKING:
    import uuid

    from outbox_kafka.relay.batch import Claim, EventOutcome, KeyOutcome, RecordResult, Remaining
    from outbox_kafka.relay.wake import Wakeups


class Message(NamedTuple):
    """One message to send, as stored by the producer side."""

    topic: str
    key: bytes
    value: bytes
    headers: list[tuple[str, bytes]]
    #: The event's id (text form), for traces; empty when not known.
    event_id: str = ""


@dataclass
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


class ClaimStore(Protocol):
    """Where the relay claims events and records what became of them."""

    url_for_logs: str
    #: Whether the last claim left producers' arrivals behind (go again at once).
    arrivals_left: bool

    def claim(
        self, *, batch_size: int, lease_seconds: float, max_keys: int | None, max_bytes: int
    ) -> Claim: ...

    def record(
        self, token: uuid.UUID, keys: Sequence[KeyOutcome], events: Sequence[EventOutcome]
    ) -> RecordResult: ...

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
