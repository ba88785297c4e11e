"""In-memory fakes of the relay's two boundaries, for tests without PostgreSQL or Kafka.

:class:`InMemoryStore` keeps an outbox in memory with the store's contract (per-key
sequence numbers, keys claimed in their order in the queue, the claim's byte budget,
leases fenced by a claim token, retries, parking);
:class:`StubPublisher` records what would reach Kafka and answers as told. A
:class:`~outbox_kafka.relay.Relay` runs on them unchanged, so a test can check the
messages an application's events become, exactly as the relay would send them::

    store, kafka = InMemoryStore(), StubPublisher()
    outbox = store.outbox(source="/orders")     # an Outbox that writes into the store
    place_order(session, outbox)                # the code under test calls outbox.enqueue
    Relay(settings, store=store, publisher=kafka).drain()
    assert [m.key for m in kafka.messages("orders")] == [b"o-1"]

They are fakes: no transactions, no concurrency between relays, and
``Relay.run()`` still starts its database sampler; use ``drain()``.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from outbox_kafka.errors import DuplicateEventId
from outbox_kafka.limits import DEFAULT_MAX_CLAIM_BYTES
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.producer.outbox import Event, Outbox
from outbox_kafka.producer.writing import Connectable, OutboxWriter
from outbox_kafka.relay.batch import (
    HELD_REASONS_SHOWN,
    Claim,
    ClaimedEvent,
    ClaimedKey,
    Doubts,
    EventOutcome,
    EventStatus,
    Floor,
    KeyOutcome,
    Problem,
    RecordResult,
    Remaining,
    Verdict,
)
from outbox_kafka.relay.ports import Delivery, Found, Message, ReadBack
from outbox_kafka.relay.wake import Wakeups
from outbox_kafka.stored_headers import headers_size

if TYPE_CHECKING:
    from outbox_kafka.producer.writing import AsyncConnectable

__all__ = ["InMemoryStore", "StoredEvent", "StubPublisher", "Verdict"]


@dataclass
class StoredEvent:
    """One event row of an :class:`InMemoryStore`."""

    event_id: str
    key: str
    seq: int
    topic: str
    type: str
    value: bytes
    headers: list[tuple[str, bytes]]
    available_at: float = 0.0
    status: EventStatus = EventStatus.PENDING
    attempts: int = 0
    error: str | None = None
    partition: int | None = None
    offset: int | None = None
    finished_at: float | None = None
    #: When it was written, on the store's clock: a discarded event's retention
    #: counts from here, as the relay's store counts it (from ``created_at``).
    created_at: float = 0.0


@dataclass
class _Key:
    next_seq: int = 1
    #: The key's place in the queue: it is claimed when this time has come, the
    #: keys due first first. While leased, the lease's end.
    due_at: float = 0.0
    token: uuid.UUID | None = None
    lease_until: float = 0.0
    parked: bool = False
    events: list[StoredEvent] = field(default_factory=list)
    #: The key's counter: the last sequence number handed out (kept when retention
    #: deletes the events; gone, and started again from 1, with the key itself).
    last_seq: int = 0
    #: Whether the key is in the queue (the relay's store has a row for it in the
    #: key queue or among the arrivals): from its first event until a record
    #: finds it drained, even when none of its events is left pending.
    queued: bool = False
    #: The relay session of the key's current claim.
    claim_session: str | None = None
    #: The relay sessions that may have sent events of the key that are not recorded.
    doubt: list[str] = field(default_factory=list)
    #: The last sequence number those sessions may have sent.
    doubt_until: int | None = None

    def claim_ended_unrecorded(self) -> None:
        """The key's claim ends without a record: its session joins the doubt, up to
        the key's last event written."""
        session = self.claim_session
        if self.token is None or session is None:
            return
        if session not in self.doubt:
            self.doubt.append(session)
        self.doubt_until = max(self.doubt_until or 0, self.next_seq - 1, self.last_seq)

    def record_doubt(self, next_seq: int, session: str, until: int | None) -> None:
        """The doubt after a record that moves the key to ``next_seq``: it ends once
        past ``doubt_until``; ``session`` joins it up to ``until`` (None: it does not)."""
        if self.doubt_until is not None and next_seq > self.doubt_until:
            self.doubt, self.doubt_until = [], None
        if until is not None:
            self.doubt = [s for s in self.doubt if s != session] + [session]
            self.doubt_until = max(self.doubt_until or 0, until)


class InMemoryStore:
    """An outbox in memory, with the contract of the relay's store."""

    url_for_logs = "memory://outbox"
    arrivals_left = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._keys: dict[str, _Key] = {}
        self._clock = clock
        #: By (session, topic, partition): the floor, and when it was written.
        self._floors: dict[tuple[str, str, int], tuple[Floor, float]] = {}

    # Writing events --------------------------------------------------------------

    def outbox(self, **options: Any) -> Outbox:
        """An :class:`~outbox_kafka.Outbox` (same options) that writes into this store.

        Code under test calls ``enqueue``/``enqueue_many`` (or their ``_async``
        versions) on it as on a real outbox, with every validation; the connection
        it passes is not used (there is no transaction: an event is stored when the
        call returns).
        """
        names = TableNames(
            table=options.get("table", "outbox"), schema=options.get("db_schema", "public")
        )
        return Outbox(**options, writer=_MemoryWriter(names, self))

    def enqueue(self, outbox: Outbox, event: Event | Mapping[str, Any]) -> uuid.UUID:
        """Validate and encode ``event`` with ``outbox`` (as ``enqueue`` would) and store it."""
        encoded = outbox.encode(event if isinstance(event, Event) else Event(**event))
        self.store_encoded([encoded])
        return encoded.event_id

    def store_encoded(self, encoded: Sequence[EncodedEvent]) -> None:
        """Store events as the producer encoded them; all or none (duplicate ids refused)."""
        known = {e.event_id for e in self.events()}
        ids = [str(e.event_id) for e in encoded]
        if len(set(ids)) < len(ids) or known.intersection(ids):
            raise DuplicateEventId("event_id", "an event with this id is already in the outbox")
        for event in encoded:
            delay = event.delay_seconds or 0.0
            if event.available_at is not None:
                delay = max(delay, event.available_at.timestamp() - time.time())
            self.append(
                event.key,
                event.topic,
                event.value,
                event.headers,
                event_type=event.type,
                event_id=str(event.event_id),
                delay=delay,
            )

    def append(
        self,
        key: str,
        topic: str,
        value: bytes,
        headers: Sequence[tuple[str, bytes]] = (),
        *,
        event_type: str = "",
        event_id: str | None = None,
        delay: float = 0.0,
    ) -> StoredEvent:
        """Store an event as given (no validation): the next of its key.

        A key not in the queue joins it, due when this event is (as a producer's
        arrival does); a key in the queue, or leased, keeps its place.
        """
        state = self._keys.setdefault(key, _Key())
        seq = state.last_seq = state.last_seq + 1
        stored = StoredEvent(
            event_id or str(uuid.uuid4()),
            key,
            seq,
            topic,
            event_type,
            value,
            list(headers),
            available_at=self._clock() + delay,
            created_at=self._clock(),
        )
        if not state.queued:
            state.queued, state.due_at = True, stored.available_at
        state.events.append(stored)
        return stored

    def events(self, key: str | None = None) -> list[StoredEvent]:
        """The stored events (of ``key``), in key then sequence order."""
        keys = [key] if key is not None else sorted(self._keys)
        return [e for k in keys if k in self._keys for e in self._keys[k].events]

    def claimable_at(self, key: str) -> float | None:
        """When a claim may next take ``key``, on the store's clock: its due time, or
        its lease's end when that is later; None while it cannot be claimed at all
        (not in the queue, or parked)."""
        state = self._keys.get(key)
        return None if state is None else _claimable_at(state)

    def parked_keys(self) -> list[str]:
        return sorted(k for k, s in self._keys.items() if s.parked)

    # What operators do ---------------------------------------------------------------

    def requeue(self, event_ids: Iterable[str]) -> int:
        """Put discarded events back to pending, as ``outbox-kafka requeue`` does:
        attempts 0, due now; each key from its earliest requeued event, unparked. A
        key a relay holds is taken back (that relay's record of it is ignored), and
        is not claimed before its lease ends. Returns how many were requeued."""
        now = self._clock()
        wanted = set(event_ids)
        firsts: dict[str, int] = {}
        requeued = 0
        for name, state in self._keys.items():
            for event in state.events:
                if event.event_id in wanted and event.status == EventStatus.DISCARDED:
                    event.status, event.attempts, event.error = EventStatus.PENDING, 0, None
                    event.available_at, event.finished_at = now, None
                    firsts[name] = min(firsts.get(name, event.seq), event.seq)
                    requeued += 1
        for name, first in firsts.items():
            state = self._keys[name]
            state.next_seq = min(state.next_seq, first)
            state.parked, state.queued = False, True
            # Due now, unless it waits already (a lease, or a message that may land).
            state.due_at = max(state.due_at, now)
            state.claim_ended_unrecorded()
            state.token = None
        return requeued

    def unpark(self, keys: Iterable[str]) -> int:
        """Let parked keys flow again, as ``outbox-kafka unpark`` does; returns how many."""
        now = self._clock()
        unparked = 0
        for name in keys:
            state = self._keys.get(name)
            if state is not None and state.parked:
                state.parked, state.due_at = False, max(state.due_at, now)
                unparked += 1
        return unparked

    # The store's contract ----------------------------------------------------------

    def claim(
        self,
        *,
        batch_size: int,
        lease_seconds: float,
        max_keys: int | None = None,
        max_bytes: int = DEFAULT_MAX_CLAIM_BYTES,
        session: uuid.UUID | None = None,
    ) -> Claim:
        """Lease up to ``max_keys`` keys (default ``batch_size``) and read their next
        events, as the relay's store does (``claim_keys`` and ``claim_events``).

        The keys due, not parked and not leased are taken in their order in the
        queue (due time, then name), and leased for ``lease_seconds``. Each brings
        up to its even share of ``batch_size`` events; the byte budget
        (:meth:`_fit_budget`) leaves the rest out and marks their keys withheld.
        """
        now = self._clock()
        token = uuid.uuid4()
        line = sorted(
            (
                (name, state)
                for name, state in self._keys.items()
                if (at := _claimable_at(state)) is not None and at <= now
            ),
            key=lambda item: (item[1].due_at, item[0]),
        )[: max_keys or batch_size]
        per_key = max(1, batch_size // max(1, len(line)))
        read = [(name, _pending(state)[:per_key]) for name, state in line]
        brought = self._fit_budget(read, max_bytes)
        keys: list[ClaimedKey] = []
        for (name, state), (_, events) in zip(line, read, strict=True):
            state.claim_ended_unrecorded()
            claimed = ClaimedKey(
                name,
                state.next_seq,
                last_seq=state.last_seq,
                withheld=brought[name] < len(events),
                due_at=state.due_at,
                doubt=tuple(state.doubt),
            )
            state.token, state.lease_until = token, now + lease_seconds
            state.claim_session = None if session is None else str(session)
            state.due_at = now + lease_seconds
            for e in events[: brought[name]]:
                claimed.events.append(
                    ClaimedEvent(
                        e.event_id,
                        name,
                        e.seq,
                        e.topic,
                        e.type,
                        e.value,
                        list(e.headers),
                        e.attempts,
                        e.available_at <= now,
                        max(0.0, e.available_at - now),
                    )
                )
            keys.append(claimed)
        keys.sort(key=lambda k: k.key)  # as claim_events returns them
        return Claim(token, keys, per_key, session)

    @staticmethod
    def _fit_budget(
        line: Sequence[tuple[str, Sequence[StoredEvent]]], max_bytes: int
    ) -> dict[str, int]:
        """How many of each key's events a claim of ``max_bytes`` brings.

        ``line`` holds the claimed keys in their order in the queue, each with
        the events read for it. As in ``claim_events``, the bytes are counted
        round robin: every key's first event, then every key's second, and so
        on, the keys in that order each time. An event that starts at or past
        the budget is left out, and so is every event after it in that order:
        a key due earlier is served before one due later, and a key the budget
        left out keeps its place for the next claim (its record keeps its due
        time). The first event always comes (the budget is positive).

        An event counts its value and its headers' names and values. PostgreSQL
        counts the headers' stored jsonb instead (a few bytes more per header,
        less when compressed): where the budget ends within a few bytes of an
        event's start, the two may bring one event more or fewer.
        """
        brought = {name: 0 for name, _ in line}
        used = 0
        for position in range(max((len(events) for _, events in line), default=0)):
            for name, events in line:
                if position >= len(events):
                    continue
                if used >= max_bytes:
                    return brought
                event = events[position]
                used += len(event.value) + headers_size(event.headers)
                brought[name] += 1
        return brought

    def record(
        self,
        token: uuid.UUID,
        keys: Sequence[KeyOutcome],
        events: Sequence[EventOutcome],
        doubts: Doubts | None = None,
    ) -> RecordResult:
        now = self._clock()
        owned = {k.key for k in keys if self._owns(k.key, token)}
        if doubts is not None and len(owned) == len(keys):
            for (topic, partition), offset in doubts.floors.items():
                found = self._floors.get((str(doubts.session), topic, partition))
                if found is not None:
                    floor, written = found
                    raised = floor._replace(offset=max(floor.offset, offset))
                    self._floors[(str(doubts.session), topic, partition)] = (
                        raised,
                        written,
                    )
        counts = {status: 0 for status in EventStatus}
        latencies: list[float] = []
        for outcome in events:
            if outcome.key not in owned:
                continue
            stored = next(
                e for e in self._keys[outcome.key].events if e.event_id == outcome.event_id
            )
            if stored.status != EventStatus.PENDING:  # as the database: a finished event stays
                continue
            if outcome.status == EventStatus.DELIVERED:
                latencies.append(now - stored.created_at)
            stored.status = outcome.status
            stored.attempts += outcome.attempts_added
            stored.available_at = now + outcome.delay
            stored.partition, stored.offset = outcome.partition, outcome.offset
            if outcome.error is not None:  # as the database does: no error keeps the last
                stored.error = outcome.error
            if outcome.status != EventStatus.PENDING:
                stored.finished_at = now
            counts[outcome.status] += 1
        removed = 0
        for key in keys:
            if key.key not in owned:
                continue
            state = self._keys[key.key]
            state.token, state.lease_until = None, 0.0
            state.record_doubt(
                key.next_seq,
                str(doubts.session) if doubts is not None else "",
                doubts.doubtful.get(key.key) if doubts is not None else None,
            )
            state.next_seq = key.next_seq
            state.due_at = now + key.delay if key.due_at is None else key.due_at
            state.parked = key.park
            if key.drained and not key.park and state.last_seq < key.next_seq:
                # The queue row goes, and with it the key's doubt.
                state.queued, state.doubt, state.claim_session = False, [], None
                state.doubt_until = None
                removed += 1
        return RecordResult(
            keys_owned=len(owned),
            keys_removed=removed,
            delivered=counts[EventStatus.DELIVERED],
            discarded=counts[EventStatus.DISCARDED],
            retried=counts[EventStatus.PENDING],
            latencies=latencies,
        )

    def remaining(self) -> Remaining:
        now = self._clock()
        counts = {"leased": 0, "parked": 0, "retrying": 0, "delayed": 0, "due": 0}
        next_due: float | None = None
        held = 0
        reasons: Counter[str] = Counter()
        for state in self._keys.values():
            pending = _pending(state)
            if not pending:
                continue
            head = pending[0]
            if state.parked:
                why = "parked"
            elif state.token is not None and state.lease_until > now:
                why = "leased"
            elif max(state.due_at, head.available_at) > now:
                why = "retrying" if head.attempts else "delayed"
                if not head.attempts and head.error is not None:
                    # Held for an operator: no attempt counted, its reason kept.
                    held += len(pending)
                    reasons[head.error] += 1
            else:
                why = "due"
            counts[why] += len(pending)
            if not state.parked:
                due = max(state.due_at, head.available_at, state.lease_until) - now
                next_due = due if next_due is None else min(next_due, due)
        return Remaining(
            pending=sum(counts.values()),
            leased=counts["leased"],
            parked=counts["parked"],
            retrying=counts["retrying"],
            delayed=counts["delayed"],
            due=counts["due"],
            unreachable=0,
            next_due_seconds=next_due,
            held=held,
            held_reason_count=len(reasons),
            held_reasons=tuple(r for r, _ in reasons.most_common(HELD_REASONS_SHOWN)),
        )

    def purge(self, *, delivered_seconds: float, discarded_seconds: float, batch: int) -> int:
        # As purge_delivered and purge_discarded: a delivered event ages from its
        # delivery, a discarded one from when it was written.
        now = self._clock()
        removed = 0

        def kept(event: StoredEvent) -> bool:
            if event.status == EventStatus.DELIVERED and event.finished_at is not None:
                return now - event.finished_at <= delivered_seconds
            if event.status == EventStatus.DISCARDED:
                return now - event.created_at <= discarded_seconds
            return True

        for name, state in list(self._keys.items()):
            kept_events = [e for e in state.events if kept(e)]
            last_purged = any(e.seq == state.last_seq and not kept(e) for e in state.events)
            removed += len(state.events) - len(kept_events)
            state.events = kept_events
            if (
                last_purged
                and not state.queued
                and not any(e.status != EventStatus.DELIVERED for e in kept_events)
            ):
                # Nothing of the key left to order (as forget_idle_counters finds it):
                # it starts again from 1.
                del self._keys[name]
        return removed

    def open_floors(self, session: uuid.UUID, floors: Sequence[Floor]) -> None:
        for floor in floors:
            self._floors.setdefault(
                (str(session), floor.topic, floor.partition),
                (floor._replace(session=str(session)), self._clock()),
            )

    def read_floors(self, sessions: Sequence[str], topics: Sequence[str]) -> list[Floor]:
        return sorted(
            (
                floor
                for floor, _ in self._floors.values()
                if floor.session in sessions and floor.topic in topics
            ),
            key=lambda f: (f.topic, f.partition, f.session),
        )

    def forget_floors(self, older_seconds: float) -> None:
        now = self._clock()
        named = {s for state in self._keys.values() for s in state.doubt}
        named.update(
            state.claim_session
            for state in self._keys.values()
            if state.token is not None and state.claim_session is not None
        )
        # As forget_floors: a session is as old as its first floor, and all its
        # floors go together.
        old = {f.session for f, written in self._floors.values() if now - written > older_seconds}
        for place, (floor, _) in list(self._floors.items()):
            if floor.session in old and floor.session not in named:
                del self._floors[place]

    def floors(self) -> list[Floor]:
        """Every floor written, in (session, topic, partition) order."""
        return [floor for _, (floor, _) in sorted(self._floors.items())]

    def doubt(self, key: str) -> list[str]:
        """The relay sessions ``key`` is in doubt about (empty: none)."""
        state = self._keys.get(key)
        return list(state.doubt) if state is not None else []

    def wakeups(self) -> Wakeups | None:
        return None

    def close(self) -> None:
        pass

    def _owns(self, key: str, token: uuid.UUID) -> bool:
        state = self._keys.get(key)
        return state is not None and state.token == token


def _claimable_at(state: _Key) -> float | None:
    """When a claim may take the key of ``state``: its due time, or its lease's end
    when later; None while it is out of the queue or parked."""
    if not state.queued or state.parked:
        return None
    if state.token is not None:
        return max(state.due_at, state.lease_until)
    return state.due_at


def _pending(state: _Key) -> list[StoredEvent]:
    """The key's pending events from its ``next_seq`` on, in sequence order."""
    return [e for e in state.events if e.seq >= state.next_seq and e.status == EventStatus.PENDING]


class _MemoryWriter(OutboxWriter):
    """An outbox's writer that stores into an :class:`InMemoryStore`."""

    def __init__(self, names: TableNames, store: InMemoryStore) -> None:
        super().__init__(names, notify=False)
        self._store = store

    def write(
        self, conn: Connectable, encoded: list[EncodedEvent], chosen_ids: bool
    ) -> list[uuid.UUID]:
        self._store.store_encoded(encoded)
        return [e.event_id for e in encoded]

    async def write_async(
        self, conn: AsyncConnectable, encoded: list[EncodedEvent], chosen_ids: bool
    ) -> list[uuid.UUID]:
        self._store.store_encoded(encoded)
        return [e.event_id for e in encoded]


#: How a :class:`StubPublisher` answers one message: a verdict, or (verdict, error).
Answer = Callable[[Message], Verdict | tuple[Verdict, str]]


class StubPublisher:
    """Records every send; answers each message with ``answer`` (default: delivered)."""

    def __init__(
        self,
        answer: Answer | None = None,
        *,
        topic_problems: Mapping[str, Problem] | None = None,
        max_message_bytes: int = 1 << 20,
        message_limits: Mapping[str, int] | None = None,
        partitions: Mapping[str, int] | None = None,
    ) -> None:
        self.answer: Answer = answer or (lambda message: Verdict.DELIVERED)
        #: By topic: how many partitions it has (1 when not given).
        self.partitions = dict(partitions or {})
        #: By (topic, partition): every message that reached the log, acknowledged
        #: or not (an answer of ``Verdict.UNREPORTED`` lands without a report).
        self.log: dict[tuple[str, int], list[Message]] = {}
        self.topic_problems = dict(topic_problems or {})
        #: By topic: the largest message it takes (as a broker's DescribeConfigs tells).
        self.message_limits = dict(message_limits or {})
        self.max_message_bytes = max_message_bytes
        #: Every send, as the list of messages it carried.
        self.sends: list[list[Message]] = []
        self._delivered: list[tuple[Message, Delivery]] = []

    def messages(self, topic: str | None = None) -> list[Message]:
        """Every message Kafka acknowledged (of ``topic``), in the order sent."""
        return [m for m, d in self._delivered if topic is None or m.topic == topic]

    def topic_problem(self, topic: str) -> Problem | None:
        return self.topic_problems.get(topic)

    def message_limit(self, topic: str) -> int | None:
        return self.message_limits.get(topic)

    def send(
        self,
        messages: Sequence[Message],
        *,
        timeout: float,
        abort: Callable[[], bool] | None = None,
    ) -> list[Delivery]:
        self.sends.append(list(messages))
        deliveries = []
        for message in messages:
            answer = self.answer(message)
            verdict, error = answer if isinstance(answer, tuple) else (answer, None)
            delivery = Delivery(verdict, error=error, sent=True, reported=True)
            partition = 0 if message.partition is None else message.partition
            if verdict in (Verdict.DELIVERED, Verdict.UNREPORTED):
                log = self.log.setdefault((message.topic, partition), [])
                log.append(message)
            if verdict == Verdict.DELIVERED:
                delivery.partition, delivery.offset = partition, len(log) - 1
                self._delivered.append((message, delivery))
            elif verdict == Verdict.UNREPORTED:
                # On Kafka, but no report came: as after a timeout, or a crash.
                delivery.reported, delivery.error = False, None
            elif error is None:
                delivery.error = f"STUB_{verdict.upper()}: answered so by the test"
            deliveries.append(delivery)
        return deliveries

    def partition_count(self, topic: str) -> int | None:
        return self.partitions.get(topic, 1)

    def reader(self) -> StubReader:
        """A reader of what this publisher's sends put on the log."""
        return StubReader(self)

    def poll(self) -> None:
        pass

    def broker_problem(self, timeout: float) -> str | None:
        return None

    def close(self, timeout: float = 5.0) -> None:
        pass


class StubReader:
    """Reads back what a :class:`StubPublisher` put on its log, as the relay's
    :class:`~outbox_kafka.relay.recover.PartitionReader` reads Kafka.

    ``unproven``: partitions it reports as not read to their end (and why), as a
    read past its deadline would. ``compacted``: topics it reports as compacted."""

    def __init__(
        self,
        publisher: StubPublisher,
        unproven: Mapping[tuple[str, int], str] | None = None,
        *,
        compacted: Collection[str] = (),
    ) -> None:
        self.publisher = publisher
        self.unproven = dict(unproven or {})
        self.compacted_topics = set(compacted)
        #: Every read asked for: its start offsets.
        self.reads: list[dict[tuple[str, int], int]] = []

    def end_offsets(self, topic: str, partitions: Sequence[int], timeout: float) -> dict[int, int]:
        return {p: len(self.publisher.log.get((topic, p), [])) for p in partitions}

    def read(
        self, starts: Mapping[tuple[str, int], int], keys: Collection[bytes], deadline: float
    ) -> ReadBack:
        self.reads.append(dict(starts))
        back = ReadBack()
        for (topic, partition), start in starts.items():
            if (topic, partition) in self.unproven:
                back.unproven[(topic, partition)] = self.unproven[(topic, partition)]
                continue
            log = self.publisher.log.get((topic, partition), [])
            if start > len(log):
                back.unproven[(topic, partition)] = "start offset past the end"
                continue
            for offset in range(start, len(log)):
                message = log[offset]
                back.read += 1
                if message.key in keys:
                    back.found.append(
                        Found(
                            topic,
                            partition,
                            offset,
                            message.key,
                            message.value,
                            list(message.headers),
                        )
                    )
            back.complete.add((topic, partition))
            back.ends[(topic, partition)] = len(log)
        return back

    def compacted(self, topic: str, timeout: float) -> bool | None:
        return topic in self.compacted_topics

    def close(self) -> None:
        pass
