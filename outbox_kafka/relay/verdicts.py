"""The closed sets the relay decides with: what became of a message, and an event's status."""

from __future__ import annotations

from enum import StrEnum


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
