"""A model-based checker of the log mode relay's promises.

A Hypothesis state machine drives the real log relay loop (``LogRelay.step``, with
every decision of checking, sending, dead-lettering, stalling, reading again and
replacing the producer) over a model of the outbox's replication slot and of a Kafka
cluster, through random interleavings of commits (events of a few keys, some of
which the broker refuses: it refuses the whole record batch they are in, and may
then fence the producer), producers that fail fatally or whose deliveries time out
(their messages landing or not), and relays killed without a word.

After every step it checks what docs/explanation/log-mode.md promises:

- a transaction is acknowledged to the slot only once each of its events is on its
  topic, or its copy is on the dead-letter topic;
- an event the broker refuses on its own goes to the dead-letter topic, never to its
  topic; no other event goes to the dead-letter topic;
- once everything committed is acknowledged, each key's events, by their last copy
  on the topic, are in commit order (an event sent again after a failure follows
  every copy sent before it);

and at the end, with every fault healed, that every committed event reached its
topic or the dead-letter topic, and the slot is acknowledged past the last
transaction. ``OUTBOX_MODEL_EXAMPLES`` sets how many sequences to try.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import hypothesis.strategies as st
from confluent_kafka import KafkaError, KafkaException
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from outbox_kafka import Event, Outbox
from outbox_kafka.log_frames import FramedEvent
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.log_reader import LogTransaction, Strays
from outbox_kafka.relay.log_relay import LogRelay

from .runs import model_settings

TOPIC, DEAD = "t", "dead"
KEYS = ("a", "b", "c")
SETTINGS = RelaySettings(
    database_url="postgresql://model@127.0.0.1:1/model",
    bootstrap_servers="127.0.0.1:1",
    # A compressing producer: topic limits are not asked of a broker (there is none).
    kafka_config={"compression.type": "lz4"},
    dead_letter_topic=DEAD,
    batch_size=3,
    lease_seconds=5.0,
    delivery_timeout_ms=3000,
    backoff_base=0.001,
    backoff_cap=0.002,
)
OUTBOX = Outbox(allow_unknown_types=True, write_to="log")


@dataclass
class Slot:
    """The server's side of the slot: committed transactions and the confirmed position."""

    transactions: list[LogTransaction] = field(default_factory=list)
    confirmed: int = 0


class Reader:
    """:class:`~outbox_kafka.relay.log_reader.LogReader` over a :class:`Slot`: a session
    reads on from the slot's confirmed position."""

    def __init__(self, slot: Slot) -> None:
        self.slot = slot
        self.strays = Strays()
        self.acknowledged = 0
        self.idle_lsn = 0
        self._position: int | None = None

    def open(self) -> None:
        self._position = self.slot.confirmed
        self.acknowledged = 0

    def close(self) -> None:
        self._position = None

    def read(self, timeout: float, max_events: int = 10_000) -> list[LogTransaction]:
        assert self._position is not None, "read before open"
        done: list[LogTransaction] = []
        count = 0
        for transaction in self.slot.transactions:
            if transaction.end_lsn <= self._position:
                continue
            if count >= max_events:
                break
            done.append(transaction)
            count += len(transaction.events)
            self._position = transaction.end_lsn
        return done

    def acknowledge(self, end_lsn: int) -> None:
        assert self._position is not None, "acknowledge before open"
        if end_lsn > self.acknowledged:
            self.acknowledged = end_lsn
            self.slot.confirmed = max(self.slot.confirmed, end_lsn)

    def keep_alive(self) -> None:
        pass


def _error(code: int, fatal: bool = False) -> KafkaError:
    return KafkaError(code, f"model: {KafkaError(code).name()}", fatal=fatal)


@dataclass
class Cluster:
    """The topics' logs, each entry (key, event id), and the faults to come."""

    logs: dict[str, list[tuple[str, str]]] = field(default_factory=lambda: {TOPIC: [], DEAD: []})
    #: The next poll's fault, and whether the messages it fails land anyway (in doubt).
    fault: tuple[str, bool] | None = None
    #: Whether a producer is fenced after the broker refuses one of its batches.
    fence_after_refusal: bool = False
    #: Whether a poll answers only the oldest message queued (the rest stay in flight).
    one_per_poll: bool = False


Pending = tuple[str, bytes, bytes, list[tuple[str, bytes]], Callable[[Any, Any], None]]


class Producer:
    """The part of confluent-kafka's ``Producer`` the relay uses, over a :class:`Cluster`.
    Each ``poll()`` sends what is queued as one record batch per topic."""

    def __init__(self, cluster: Cluster, poisoned: set[str]) -> None:
        self.cluster = cluster
        self.poisoned = poisoned
        self.pending: list[Pending] = []
        self.purged: list[Pending] = []
        self.dead = False
        self.fenced = False

    def produce(
        self, topic: str, value: bytes, key: bytes, *, headers: Any, on_delivery: Any
    ) -> None:
        if self.dead:
            raise KafkaException(_error(KafkaError._FATAL, fatal=True))
        self.pending.append((topic, key, value, list(headers or []), on_delivery))

    def list_topics(self, topic: str | None, timeout: float) -> Any:
        """The two topics are there."""
        listed = (TOPIC, DEAD) if topic is None else (topic,)
        return SimpleNamespace(
            topics={name: SimpleNamespace(error=None, partitions={0: None}) for name in listed}
        )

    def __len__(self) -> int:
        return len(self.pending) + len(self.purged)

    def purge(self, **_: Any) -> None:
        self.purged += self.pending
        self.pending = []

    def flush(self, timeout: float = 0.0) -> int:
        self.poll(timeout)
        return len(self)

    def _land(self, message: Pending) -> None:
        topic, key, _, headers, _ = message
        event_id = dict(headers).get("outbox_event_id") if topic == DEAD else None
        self.cluster.logs[topic].append((key.decode(), (event_id or b"").decode() or _id(message)))

    def land_in_doubt(self, batch: list[Pending]) -> None:
        """What lands of ``batch`` sent by a producer that reports nothing: each topic's
        record batch, unless the broker refuses it."""
        for topic in dict.fromkeys(m[0] for m in batch):
            group = [m for m in batch if m[0] == topic]
            if topic == DEAD or not any(_id(m) in self.poisoned for m in group):
                for message in group:
                    self._land(message)

    def poll(self, timeout: float = 0.0) -> int:
        purged, self.purged = self.purged, []
        for message in purged:
            message[4](_error(KafkaError._PURGE_QUEUE), None)
        cut = 1 if self.cluster.one_per_poll else len(self.pending)
        batch, self.pending = self.pending[:cut], self.pending[cut:]
        if not batch:
            return len(purged)
        fault, lands = self.cluster.fault or ("", False)
        self.cluster.fault = None
        if fault == "fatal":
            self.dead = True
            if lands:
                self.land_in_doubt(batch)
            raise KafkaException(_error(KafkaError._FATAL, fatal=True))
        if self.fenced:
            for message in batch:
                message[4](_error(KafkaError.PRODUCER_FENCED), None)
            return len(batch)
        for topic in dict.fromkeys(m[0] for m in batch):
            group = [m for m in batch if m[0] == topic]
            if topic != DEAD and any(_id(m) in self.poisoned for m in group):
                self.fenced = self.cluster.fence_after_refusal
                for message in group:
                    message[4](_error(KafkaError.INVALID_RECORD), None)
            elif fault == "timeout":
                for message in group:
                    if lands:
                        self._land(message)
                    message[4](_error(KafkaError._MSG_TIMED_OUT), None)
            else:
                for message in group:
                    self._land(message)
                    message[4](None, None)
        return len(batch)


def _id(message: Pending) -> str:
    import json

    return str(json.loads(message[2])["id"])


class LogRelayModel(RuleBasedStateMachine):
    @initialize()
    def start(self) -> None:
        self.slot = Slot()
        self.cluster = Cluster()
        self.poisoned: set[str] = set()
        #: By event id: its key and place in commit order.
        self.order: dict[str, tuple[str, int]] = {}
        self.lsn = 0
        self.relay = self._new_relay()

    def _new_relay(self) -> LogRelay:
        #: The producers the relay made, the one in use last.
        self.producers: list[Producer] = []

        def make(config: dict[str, str]) -> Producer:
            self.producers.append(Producer(self.cluster, self.poisoned))
            return self.producers[-1]

        relay = LogRelay(SETTINGS, producer_factory=make)
        relay.reader = Reader(self.slot)  # type: ignore[assignment]
        return relay

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=3),
        poison=st.lists(st.booleans(), min_size=3, max_size=3),
    )
    def commit(self, keys: list[str], poison: list[bool]) -> None:
        events = []
        for key, poisoned in zip(keys, poison, strict=False):
            encoded = OUTBOX.encode(Event(type="m.e", key=key, data={}, topic=TOPIC))
            event_id = str(encoded.event_id)
            self.order[event_id] = (key, len(self.order))
            if poisoned and len(self.poisoned) < 3:
                self.poisoned.add(event_id)
            events.append(
                FramedEvent(encoded.event_id, key, TOPIC, "m.e", encoded.headers, encoded.value)
            )
        self.lsn += 16
        self.slot.transactions.append(LogTransaction(self.lsn, time.time(), events))

    @rule()
    def step(self) -> None:
        self.relay.step(0.0)

    @rule(kind=st.sampled_from(["fatal", "timeout"]), lands=st.booleans())
    def the_next_send_fails(self, kind: str, lands: bool) -> None:
        self.cluster.fault = (kind, lands)

    @rule(fence=st.booleans())
    def brokers_fence_after_a_refusal(self, fence: bool) -> None:
        self.cluster.fence_after_refusal = fence

    @rule(slow=st.booleans())
    def brokers_answer_one_message_per_poll(self, slow: bool) -> None:
        self.cluster.one_per_poll = slow

    @rule(lands=st.booleans())
    def the_relay_is_killed(self, lands: bool) -> None:
        producer = self.producers[-1]
        if lands:  # what it had queued may still land
            producer.land_in_doubt(producer.pending)
        self.relay = self._new_relay()

    # ----------------------------------------------------------- the promises

    @invariant()
    def acknowledged_means_on_kafka(self) -> None:
        on_topic = {event_id for _, event_id in self.cluster.logs[TOPIC]}
        dead = {event_id for _, event_id in self.cluster.logs[DEAD]}
        for transaction in self.slot.transactions:
            if transaction.end_lsn > self.slot.confirmed:
                break
            for event in transaction.events:
                event_id = str(event.event_id)
                where = dead if event_id in self.poisoned else on_topic
                assert event_id in where, (
                    f"transaction {transaction.end_lsn} acknowledged, event {event_id} "
                    f"({'poisoned' if event_id in self.poisoned else 'fine'}) not there"
                )

    @invariant()
    def only_refused_events_are_set_aside(self) -> None:
        assert not {i for _, i in self.cluster.logs[TOPIC]} & self.poisoned
        assert {i for _, i in self.cluster.logs[DEAD]} <= self.poisoned

    @invariant()
    def caught_up_in_commit_order(self) -> None:
        """Whenever everything committed is acknowledged: a re-sent event's copy may be
        in flight behind an older copy of a later one until then."""
        if self.slot.confirmed >= self.lsn:
            self.last_copies_in_commit_order()

    def last_copies_in_commit_order(self) -> None:
        last: dict[str, int] = {}
        for place, (_, event_id) in enumerate(self.cluster.logs[TOPIC]):
            last[event_id] = place
        for key in KEYS:
            ids = sorted(
                (i for i in last if self.order[i][0] == key), key=lambda i: self.order[i][1]
            )
            places = [last[i] for i in ids]
            assert places == sorted(places), f"key {key}: last copies out of commit order"

    def teardown(self) -> None:
        """Every fault healed (a broker that fences after a refusal is not a fault: it
        stays so): the stream is read to its end, nothing left behind."""
        try:
            # Faults healed; a broker that fences a producer after a refusal stays so.
            self.cluster.fault = None
            self.cluster.one_per_poll = False
            for _ in range(400):
                if self.slot.confirmed >= self.lsn:
                    break
                self.relay.step(0.0)
                time.sleep(0.001)
            assert self.slot.confirmed >= self.lsn, (
                f"stuck at {self.slot.confirmed} of {self.lsn}: {self.relay.stalled}"
            )
            self.acknowledged_means_on_kafka()
            self.only_refused_events_are_set_aside()
            self.last_copies_in_commit_order()
        finally:
            self.relay.close(0)


LogRelayModel.TestCase.settings = model_settings()
TestLogRelayModel = LogRelayModel.TestCase


def test_a_model_event_id_is_read_from_the_envelope() -> None:
    encoded = OUTBOX.encode(Event(type="m.e", key="a", data={}, topic=TOPIC))
    message: Pending = (TOPIC, b"a", encoded.value, [], lambda err, msg: None)
    assert _id(message) == str(encoded.event_id)
    assert isinstance(uuid.UUID(_id(message)), uuid.UUID)
