"""The lease rule: how long a claim owns its keys, and what the relay may still do in it.

A claim leases its keys for ``lease_seconds``; every later write is fenced by the
claim's token, so once the lease has ended another relay may take the keys. The
relay therefore never has a message in flight when a lease could end:

- the Kafka delivery timeout is at most 80% of the lease (:func:`check_delivery_timeout`),
  so whatever is sent is delivered or timed out well inside it;
- nothing is sent with less than one delivery timeout of the lease left
  (:meth:`Lease.room_to_send`);
- a claim read ahead that waited too long behind a slow send has too little of its
  lease left to be sent, for the same reason: it is released and claimed afresh;
- an event still inside the producer when its batch ends keeps its key off limits
  for a whole lease (:func:`in_flight_hold`), so that no copy of it is sent
  before that one is delivered or dead.

Times are ``time.monotonic()`` values; the lease begins after its claim was asked
for, so it is counted from then.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from outbox_kafka.errors import ConfigurationError

#: The largest share of the lease the Kafka delivery timeout may take.
DELIVERY_SHARE_OF_LEASE = 0.8


def check_delivery_timeout(delivery_timeout_ms: int, lease_seconds: float) -> None:
    """Refuse a delivery timeout over 80% of the lease, saying why."""
    limit = lease_seconds * 1000 * DELIVERY_SHARE_OF_LEASE
    if delivery_timeout_ms > limit:
        raise ConfigurationError(
            f"the Kafka delivery timeout ({delivery_timeout_ms} ms) must be at most 80% of the "
            f"lease ({lease_seconds} s = {lease_seconds * 1000:.0f} ms): a message still "
            "in flight when its lease expires would be sent twice, out of order. Lower "
            "delivery.timeout.ms or raise --lease-seconds."
        )


def in_flight_hold(lease_seconds: float) -> float:
    """How long a key whose event is still inside the producer stays off limits: a
    whole lease, by when that event is delivered or dead."""
    return lease_seconds


def metadata_wait(lease_seconds: float) -> float:
    """The longest wait for a topic's metadata before a send: a small part of the lease."""
    return min(5.0, lease_seconds / 4)


@dataclass(frozen=True)
class Lease:
    """The lease of one relay loop's claims, and the delivery timeout it must cover."""

    #: How long a claim owns its keys.
    seconds: float
    #: How long a message sent may stay unacknowledged (the producer's delivery timeout).
    delivery_timeout: float

    def ends(self, asked_at: float) -> float:
        """When the lease of a claim asked for at ``asked_at`` ends."""
        return asked_at + self.seconds

    @staticmethod
    def left(ends: float) -> float:
        """Seconds left of a lease that ends at ``ends`` (negative: it has ended)."""
        return ends - time.monotonic()

    def room_to_send(self, left: float) -> bool:
        """Whether a send may start with ``left`` seconds of its lease left: all of it is
        delivered or timed out before another relay can take the keys."""
        return left >= self.delivery_timeout

    def still_usable(self, asked_at: float) -> bool:
        """Whether a claim asked for at ``asked_at`` (read ahead) may still be sent."""
        return self.room_to_send(self.left(self.ends(asked_at)))
