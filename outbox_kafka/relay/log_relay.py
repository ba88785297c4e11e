"""The log mode's relay loop: committed transactions read from the outbox's slot
(:mod:`~outbox_kafka.relay.log_reader`), their events produced in stream order with
the idempotent producer, and the slot acknowledged up to the highest end LSN below
which every event has been delivered.

Stream order is commit order, and a key's events all go to one partition, in which
the idempotent producer keeps the order they were produced in: so a key's events
reach Kafka in the order their transactions committed. Nothing waits on a claim,
a lease or a record: the only state is the slot's acknowledged position, kept by
the server.

An event that Kafka does not take (its delivery failed for good, or the producer
refused it) stops the stream before it: :class:`LogStalled` is raised once every
transaction before it is acknowledged, and nothing after it is. A relay started
again reads on from there; events after the last acknowledgement that had reached
Kafka are sent again (at least once). The polling relay's retries, parking and
dead-letter topic are not part of this mode yet.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaException, Producer

from outbox_kafka.errors import EventError
from outbox_kafka.log_frames import FramedEvent
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.log_reader import LogReader, LogTransaction
from outbox_kafka.topic_names import check_topic


class LogStalled(RuntimeError):
    """An event could not be published: the stream stops before it."""


@dataclass
class _InFlight:
    """A transaction whose events are produced and not all reported yet."""

    end_lsn: int
    #: Its events, and those of them not reported yet.
    size: int
    remaining: int
    #: Why an event of it was not delivered (the first such), if one was not.
    failure: str | None = None


class LogRelay:
    """One outbox's log-mode relay loop; not thread-safe, not public API."""

    def __init__(
        self,
        settings: RelaySettings,
        *,
        producer_factory: Callable[[dict[str, str]], Any] = Producer,
    ) -> None:
        self.settings = settings
        self.reader = LogReader(settings.database_url, settings.names)
        self._producer = producer_factory(settings.producer_config())
        self._in_flight: deque[_InFlight] = deque()
        #: At most this many events produced and not yet acknowledged.
        self._max_in_flight = max(1, settings.batch_size) * 4
        self._events_in_flight = 0
        #: Events delivered and acknowledged since the relay started.
        self.published = 0

    def open(self) -> None:
        """Start reading the slot (:class:`~outbox_kafka.relay.log_reader.SlotBusy` while
        another session reads it)."""
        self.reader.open()

    def step(self, timeout: float) -> int:
        """Read what has committed (waiting up to ``timeout`` when nothing is in flight),
        send it, and acknowledge what is delivered; the events acknowledged."""
        room = self._max_in_flight - self._events_in_flight
        if room > 0:
            wait = 0.0 if self._in_flight else timeout
            for transaction in self.reader.read(wait, max_events=room):
                self._send(transaction)
        self._producer.poll(0.05 if self._in_flight else 0)
        return self._acknowledge()

    def drain(self, idle: float = 1.0, deadline: float = 60.0) -> int:
        """Publish until nothing new has committed for ``idle`` seconds and everything read
        is acknowledged; the events acknowledged."""
        published = 0
        quiet_since = time.monotonic()
        give_up = time.monotonic() + deadline
        while time.monotonic() < give_up:
            before = self.reader.acknowledged
            got = self.step(min(idle, 0.2))
            published += got
            if got or self._in_flight or self.reader.acknowledged != before:
                quiet_since = time.monotonic()
            elif time.monotonic() - quiet_since >= idle:
                return published
        raise LogStalled(f"the stream did not go quiet within {deadline:.0f} s")

    def close(self, timeout: float = 10.0) -> None:
        """Wait (up to ``timeout``) for what is in flight, acknowledge what was delivered,
        and stop reading."""
        try:
            deadline = time.monotonic() + timeout
            while self._in_flight and time.monotonic() < deadline:
                self._producer.poll(0.05)
                try:
                    self._acknowledge()
                except LogStalled:
                    break
        finally:
            self.reader.close()
            self._producer.flush(0)

    def _send(self, transaction: LogTransaction) -> None:
        size = len(transaction.events)
        entry = _InFlight(transaction.end_lsn, size, size)
        self._in_flight.append(entry)
        self._events_in_flight += size
        for event in transaction.events:
            self._produce(event, entry)

    def _produce(self, event: FramedEvent, entry: _InFlight) -> None:
        def report(err: Any, _msg: Any) -> None:
            if err is not None and entry.failure is None:
                entry.failure = f"event {event.event_id} (key {event.key!r}): {err}"
            entry.remaining -= 1

        try:
            check_topic(event.topic)
        except EventError as exc:
            report(f"INVALID_TOPIC: {exc.reason}", None)
            return
        while True:
            try:
                self._producer.produce(
                    event.topic,
                    event.value,
                    event.key.encode("utf-8"),
                    headers=event.headers,
                    on_delivery=report,
                )
                return
            except BufferError:
                self._producer.poll(0.1)
            except KafkaException as exc:
                report(exc.args[0] if exc.args else exc, None)
                return

    def _acknowledge(self) -> int:
        """Acknowledge the transactions at the front that are wholly delivered; raise
        :class:`LogStalled` at the first that is not."""
        done = 0
        last: int | None = None
        while self._in_flight and self._in_flight[0].remaining <= 0:
            head = self._in_flight[0]
            if head.failure is not None:
                if last is not None:
                    self.reader.acknowledge(last)
                    self.published += done
                raise LogStalled(
                    f"{head.failure}; the stream stops before it, acknowledged up to LSN "
                    f"{self.reader.acknowledged:X}"
                )
            self._in_flight.popleft()
            self._events_in_flight -= head.size
            done += head.size
            last = head.end_lsn
        if last is not None:
            self.reader.acknowledge(last)
            self.published += done
        return done
