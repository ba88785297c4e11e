"""A model-based checker of the relay's promises.

A Hypothesis state machine drives the real relay loop (``Relay.cycle`` and
``Relay.drain``, with every decision of planning, policy and sending) over the
in-memory store and a small model of a Kafka cluster, through random
interleavings of writes (keys, sizes, topics, delays, events the broker refuses),
claims under a byte budget, sends whose messages are acknowledged, fail
transiently, get no report (and land later, or never), go to a topic that does
not exist yet or ride a record batch the broker refuses whole (after which it
may fence the producer, failing its next send whole); lease expiries;
relays killed between send and record; a database that fails a record, or is
gone for good while a relay shuts down; and operators requeueing discarded
events, unparking keys and purging what is done.

After every step it checks what the documentation promises
(docs/explanation/guarantees.md):

- per-key commit order, by each event's first occurrence on the topics;
- nothing discarded but what the broker refuses on its own;
- no attempt counted against an event the broker did not fail (a fenced
  producer is not the event's fault);
- no key sent, nor claimable, while a message of it may still land (an
  unreported message, within its delivery timeout);
- no due key left out of a claim by the byte budget while keys that became
  due after it are served, more than ``FAIRNESS_BOUND`` claims in a row;
- at most two batches per relay sent and never recorded (a batch is recorded
  while the next one is sent);

and at the end, with every fault healed, that every committed event was
delivered or discarded for a reason of its own. A failure shrinks to the
shortest sequence of steps that shows it, printed as code to paste into a
regression test. ``OUTBOX_MODEL_EXAMPLES`` sets how many sequences to try
(``make chaos`` tries many more than ``make test``).
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis.strategies as st
from confluent_kafka import KafkaError
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from tenacity import wait_fixed

from outbox_kafka import Event, Outbox
from outbox_kafka.errors import StorageError
from outbox_kafka.relay import Relay
from outbox_kafka.relay import loop as relay_loop
from outbox_kafka.relay.batch import (
    Claim,
    EventOutcome,
    EventStatus,
    KeyOutcome,
    Problem,
    RecordResult,
    Remaining,
    Verdict,
)
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.relay.send import classify
from outbox_kafka.testing import InMemoryStore

from .runs import model_settings

#: Claims in a row a due key may be left out of by the byte budget while a key
#: that became due after it is served (docs/explanation/guarantees.md).
FAIRNESS_BOUND = 2

LEASE_SECONDS = 30.0
DELIVERY_TIMEOUT = 24.0
TOPICS = ("t1", "t2")
KEYS = ("a", "b", "c", "z")


class Killed(Exception):
    """The relay's process is gone: nothing it does reaches the database any more."""


# ------------------------------------------------------------------ the model's clock


class Clock:
    """The store's clock: moved by the model, and a microsecond further at each
    reading, as the database's ``now()`` moves between transactions."""

    def __init__(self) -> None:
        self.now = 1000.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            self.now += 1e-6
            return self.now


# ------------------------------------------------------------------ the model of Kafka


@dataclass
class Zombie:
    """A message the producer took and never reported: it lands before its
    delivery timeout ends, or never."""

    message: Message
    deadline: float
    lands: bool


@dataclass
class Cluster:
    """Topics, how each answers now, and everything that landed, in order."""

    clock: Clock
    #: Per topic: "ok", "transient" (each message fails, retriably), "unreported"
    #: (taken, no report) or "missing" (the topic does not exist).
    weather: dict[str, str] = field(default_factory=lambda: dict.fromkeys(TOPICS, "ok"))
    #: Whether unreported messages land (decided when they are sent).
    zombies_land: bool = True
    #: Whether a relay's wait for reports ends early (it is shutting down, or its
    #: producer failed): behind a failed message, the key's later ones go unreported.
    reports_cut_short: bool = False
    #: Every message that landed, in order: (event id, key).
    log: list[tuple[str, str]] = field(default_factory=list)
    zombies: list[Zombie] = field(default_factory=list)
    #: Event ids the broker refuses whatever batch they are in, alone too.
    poisoned: set[str] = field(default_factory=set)
    #: Whether a refused record batch fences the producer that sent it.
    fences_after_refusal: bool = False
    #: Per event id: how often the broker failed it (a transient error).
    failures: dict[str, int] = field(default_factory=dict)
    violations: list[str] = field(default_factory=list)

    def may_still_land(self, key: bytes) -> bool:
        return any(z.message.key == key for z in self.zombies)

    def resolve_zombies(self, *, all_of_them: bool = False) -> None:
        """Unreported messages whose delivery timeout has ended land or die, in order."""
        now = self.clock.now
        kept = []
        for zombie in self.zombies:
            if all_of_them or zombie.deadline <= now:
                if zombie.lands:
                    self.log.append((zombie.message.event_id, zombie.message.key.decode()))
            else:
                kept.append(zombie)
        self.zombies = kept


class Broker:
    """One relay's producer on the model cluster (a relay's MessagePublisher)."""

    max_message_bytes = 1 << 20

    def __init__(self, cluster: Cluster, database: Database) -> None:
        self.cluster = cluster
        self.database = database
        #: The broker fenced this producer: its next send fails whole.
        self.fenced = False
        #: The claims whose events this producer was handed.
        self.sent_claims: set[uuid.UUID] = set()

    def topic_problem(self, topic: str) -> Problem | None:
        if self.cluster.weather[topic] == "missing":
            verdict = classify(KafkaError._UNKNOWN_TOPIC, reported=False)
            return verdict, f"UNKNOWN_TOPIC: topic {topic!r} does not exist"
        return None

    def message_limit(self, topic: str) -> int | None:
        return None

    def send(
        self,
        messages: Sequence[Message],
        *,
        timeout: float,
        abort: Callable[[], bool] | None = None,
    ) -> list[Delivery]:
        cluster = self.cluster
        for message in messages:
            if cluster.may_still_land(message.key):
                cluster.violations.append(
                    f"key {message.key.decode()} sent while a message of it may still land"
                )
        if self.fenced:
            # The relay rebuilds its producer after this send.
            self.fenced = False
            self.sent_claims.update(self.database.token_of[m.event_id] for m in messages)
            verdict = classify(KafkaError.PRODUCER_FENCED, reported=True)
            return [_reported(verdict, "PRODUCER_FENCED: fenced") for _ in messages]
        refused_topics = {m.topic for m in messages if m.event_id in cluster.poisoned}
        self.fenced = bool(refused_topics) and cluster.fences_after_refusal
        #: Per key, what its first message that did not get through became: the
        #: idempotent producer keeps a partition's order, so the rest follow it.
        failed: dict[bytes, Delivery] = {}
        deliveries = []
        for message in messages:
            self.sent_claims.add(self.database.token_of[message.event_id])
            if message.topic in refused_topics:
                code = classify(KafkaError.INVALID_RECORD, reported=True)
                delivery = _reported(code, "INVALID_RECORD: the broker refused the record batch")
            elif message.key in failed:
                earlier = failed[message.key]
                delivery = Delivery(
                    earlier.verdict,
                    error=earlier.error,
                    sent=True,
                    reported=earlier.reported and not cluster.reports_cut_short,
                )
            else:
                delivery = self._answer(message)
            if not delivery.reported:
                lands = cluster.zombies_land and message.key not in failed
                deadline = cluster.clock.now + DELIVERY_TIMEOUT
                cluster.zombies.append(Zombie(message, deadline, lands))
            if delivery.verdict == Verdict.DELIVERED and delivery.reported:
                cluster.log.append((message.event_id, message.key.decode()))
            else:
                failed.setdefault(message.key, delivery)
            deliveries.append(delivery)
        return deliveries

    def _answer(self, message: Message) -> Delivery:
        weather = self.cluster.weather[message.topic]
        if weather == "transient":
            failures = self.cluster.failures
            failures[message.event_id] = failures.get(message.event_id, 0) + 1
            return _reported(Verdict.RETRIABLE, "REQUEST_TIMED_OUT: the broker is slow")
        if weather == "unreported":
            return Delivery(sent=True, reported=False, error="NO_REPORT: still in the producer")
        if weather == "missing":
            verdict = classify(KafkaError.UNKNOWN_TOPIC_OR_PART, reported=True)
            return _reported(verdict, "UNKNOWN_TOPIC_OR_PART: no such topic")
        return Delivery(Verdict.DELIVERED, 0, len(self.cluster.log), sent=True, reported=True)

    def poll(self) -> None:
        pass

    def broker_problem(self, timeout: float) -> str | None:
        return None

    def close(self, timeout: float = 5.0) -> None:
        pass


def _reported(verdict: Verdict, error: str) -> Delivery:
    return Delivery(verdict, error=error, sent=True, reported=True)


# ------------------------------------------------------------------ one relay's database


class Database:
    """One relay's way to the shared in-memory outbox: it can fail, or die."""

    url_for_logs = "memory://model"

    def __init__(self, store: InMemoryStore, model: RelayModel) -> None:
        self.store = store
        self.model = model
        self.lock = model.lock
        self.killed = False
        #: Records fail (StorageError) while this is set; ``failures`` counts them.
        self.down = False
        self.failures = threading.Semaphore(0)
        #: Records that fail once more, then succeed.
        self.flaky_records = 0
        #: The next record never happens: the relay is killed just before it.
        self.kill_before_record = False
        self.claimed_tokens: set[uuid.UUID] = set()
        self.recorded_tokens: set[uuid.UUID] = set()
        #: Claim token of each event this relay claimed.
        self.token_of: dict[str, uuid.UUID] = {}

    @property
    def arrivals_left(self) -> bool:
        return False

    def _alive(self) -> None:
        if self.killed:
            raise Killed

    def claim(
        self, *, batch_size: int, lease_seconds: float, max_keys: int | None, max_bytes: int
    ) -> Claim:
        with self.lock:
            self._alive()
            claim = self.store.claim(
                batch_size=batch_size,
                lease_seconds=lease_seconds,
                max_keys=max_keys,
                max_bytes=max_bytes,
            )
            self.claimed_tokens.add(claim.token)
            for key in claim.keys:
                for event in key.events:
                    self.token_of[event.event_id] = claim.token
            self.model.observe_claim(claim)
            return claim

    def record(
        self, token: uuid.UUID, keys: Sequence[KeyOutcome], events: Sequence[EventOutcome]
    ) -> RecordResult:
        with self.lock:
            self._alive()
            if self.kill_before_record:
                self.killed = True
                raise Killed
            if self.down or self.flaky_records:
                self.flaky_records = max(0, self.flaky_records - 1)
                self.failures.release()
                raise StorageError("the database is down")
            self.recorded_tokens.add(token)
            return self.store.record(token, keys, events)

    def remaining(self) -> Remaining:
        with self.lock:
            self._alive()
            return self.store.remaining()

    def purge(self, *, delivered_seconds: float, discarded_seconds: float, batch: int) -> int:
        return 0  # retention is the model's own step

    def wakeups(self) -> None:
        return None

    def close(self) -> None:
        pass


# ------------------------------------------------------------------ the state machine


@dataclass
class Written:
    event_id: str
    key: str
    #: Its place in its key's commit order.
    order: int
    poisoned: bool


class RelayModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        # Database retries a few milliseconds apart, not a tenth of a second and more.
        self._wait = relay_loop.wait_exponential_jitter
        relay_loop.wait_exponential_jitter = lambda **_: wait_fixed(0.005)  # type: ignore[assignment]
        self.lock = threading.RLock()
        self.clock = Clock()
        self.store = InMemoryStore(clock=self.clock)
        self.cluster = Cluster(self.clock)
        self.outbox = Outbox(source="/model", allow_unknown_types=True)
        self.written: dict[str, Written] = {}
        self.commits: dict[str, int] = {}
        self.relays: list[tuple[Relay, Database, Broker]] = []
        self.violations = self.cluster.violations
        #: Per key the budget left out: its place when it was first left out.
        self.waiting: dict[str, float] = {}
        self.left_out: dict[str, int] = {}
        self.claims = 0
        self.batch_size = 4
        self.max_claim_bytes = 2000
        self.on_exhausted = "continue"
        for _ in range(2):
            self.relays.append(self._new_relay())

    @initialize(
        batch_size=st.sampled_from([2, 4]),
        max_claim_bytes=st.sampled_from([2000, 1 << 25]),
        on_exhausted=st.sampled_from(["continue", "park"]),
    )
    def configure(self, batch_size: int, max_claim_bytes: int, on_exhausted: str) -> None:
        """Relays with this batch size, byte budget and way after a discard (a small
        batch leaves keys for the claim read ahead while a batch is sent)."""
        self.batch_size, self.max_claim_bytes = batch_size, max_claim_bytes
        self.on_exhausted = on_exhausted
        self.relays = [self._new_relay() for _ in range(2)]

    def _new_relay(self) -> tuple[Relay, Database, Broker]:
        database = Database(self.store, self)
        broker = Broker(self.cluster, database)
        relay_settings = RelaySettings(
            database_url="postgresql://model/outbox",
            bootstrap_servers="model:9092",
            listen=False,
            batch_size=self.batch_size,
            max_claim_bytes=self.max_claim_bytes,
            max_attempts=1000,
            lease_seconds=LEASE_SECONDS,
            delivery_timeout_ms=int(DELIVERY_TIMEOUT * 1000),
            backoff_base=0.2,
            backoff_cap=2.0,
            shutdown_timeout=0.02,
            on_exhausted=self.on_exhausted,  # type: ignore[arg-type]
        )
        relay = Relay(relay_settings, store=database, publisher=broker)  # type: ignore[arg-type]
        relay.policy.rng.seed(len(self.relays))
        return relay, database, broker

    def _replace(self, index: int) -> None:
        """The relay at ``index`` has ended: check what it left, start another."""
        _, database, broker = self.relays[index]
        left = len(broker.sent_claims - database.recorded_tokens)
        if left > 2:
            self.violations.append(f"a relay ended with {left} batches sent and not recorded")
        # Its keys come due again when their leases end, all at once: the wait
        # the budget's order promises to shorten starts again there.
        self.waiting.clear()
        self.left_out.clear()
        self.relays[index] = self._new_relay()

    # -------------------------------------------------------------- what the model promises

    def observe_claim(self, claim: Claim) -> None:
        """Count the claims in a row that leave a due key out for its bytes while a
        key that became due after it is served.

        A key's place is its due time when claimed (its commit, its last record
        and backoff, its lease's end); a key the budget leaves out keeps the
        place it had, however often it is left out in a row.
        """
        self.claims += 1
        now = self.clock.now
        served: dict[str, float] = {}
        starved: list[str] = []
        for key in claim.keys:
            assert key.due_at is not None
            pending = [
                e
                for e in self.store.events(key.key)
                if e.status == EventStatus.PENDING and e.seq >= key.next_seq
            ]
            if key.events:
                served[key.key] = key.due_at
            elif key.withheld and pending and pending[0].available_at <= now:
                since = min(self.waiting.get(key.key, key.due_at), key.due_at)
                self.waiting[key.key] = since
                starved.append(key.key)
                continue
            self.waiting.pop(key.key, None)
            self.left_out.pop(key.key, None)
        for key in starved:
            if any(due > self.waiting[key] for due in served.values()):
                self.left_out[key] = self.left_out.get(key, 0) + 1
                if self.left_out[key] > FAIRNESS_BOUND:
                    self.violations.append(
                        f"key {key} left out of {self.left_out[key]} claims in a row "
                        "while keys due after it were served"
                    )
            else:
                self.left_out.pop(key, None)

    @invariant()
    def promises_hold(self) -> None:
        with self.lock:
            assert not self.violations, self.violations
            self._check_order()
            self._check_discards()
            self._check_attempts()
            self._check_held_while_in_producer()

    def _check_order(self) -> None:
        seen: set[str] = set()
        last: dict[str, int] = {}
        for event_id, key in self.cluster.log:
            if event_id in seen:
                continue
            seen.add(event_id)
            order = self.written[event_id].order
            assert order > last.get(key, 0), (
                f"key {key}: event {order} in its commit order landed after event {last[key]}"
            )
            last[key] = order

    def _check_discards(self) -> None:
        for stored in self.store.events():
            if stored.status == EventStatus.DISCARDED:
                written = self.written[stored.event_id]
                assert written.poisoned, (
                    f"key {written.key}: event {written.order} discarded, though the broker "
                    f"takes it alone: {stored.error}"
                )

    def _check_held_while_in_producer(self) -> None:
        """A key with a message that may still land is not claimable before that
        message's delivery timeout ends, whatever else holds the key: caught when the
        key is handed back, not only if a relay happens to send it again in time."""
        now = self.clock.now
        for zombie in self.cluster.zombies:
            key = zombie.message.key.decode()
            at = self.store.claimable_at(key)
            assert at is None or at >= zombie.deadline, (
                f"key {key} may be claimed in {at - now:.1f} s, while a message of it "
                f"may still land for {zombie.deadline - now:.1f} s"
            )

    def _check_attempts(self) -> None:
        for stored in self.store.events():
            written = self.written[stored.event_id]
            failed = self.cluster.failures.get(stored.event_id, 0)
            assert written.poisoned or stored.attempts <= failed, (
                f"key {written.key}: event {written.order} has {stored.attempts} attempts "
                f"counted, though the broker failed it {failed} times: {stored.error}"
            )

    # -------------------------------------------------------------- writers

    @rule(
        key=st.sampled_from(KEYS),
        topic=st.sampled_from(TOPICS),
        padding=st.sampled_from([0, 0, 600, 2500]),
        poisoned=st.sampled_from([False] * 6 + [True]),
        delay=st.sampled_from([0.0] * 4 + [2.0]),
    )
    def write(self, key: str, topic: str, padding: int, poisoned: bool, delay: float) -> None:
        with self.lock:
            data: dict[str, Any] = {"pad": "x" * padding}
            event = Event(type="model.event", key=key, topic=topic, data=data)
            encoded = self.outbox.encode(event)
            stored = self.store.append(
                key,
                topic,
                encoded.value,
                encoded.headers,
                event_type=encoded.type,
                event_id=str(encoded.event_id),
                delay=delay,
            )
            self.commits[key] = self.commits.get(key, 0) + 1
            self.written[stored.event_id] = Written(
                stored.event_id, key, self.commits[key], poisoned
            )
            if poisoned:
                self.cluster.poisoned.add(stored.event_id)

    @rule(
        keys=st.lists(st.sampled_from(KEYS), min_size=2, max_size=6),
        topic=st.sampled_from(TOPICS),
        padding=st.sampled_from([0, 2500]),
    )
    def writers_commit_at_once(self, keys: list[str], topic: str, padding: int) -> None:
        """Several writers commit an event each at once: a backlog of several
        batches (one key each when the events are larger than the byte budget)."""
        for key in keys:
            self.write(key=key, topic=topic, padding=padding, poisoned=False, delay=0.0)

    # -------------------------------------------------------------- the cluster

    @rule(
        topic=st.sampled_from(TOPICS),
        weather=st.sampled_from(["ok", "ok", "transient", "unreported", "missing"]),
    )
    def weather(self, topic: str, weather: str) -> None:
        self.cluster.weather[topic] = weather

    @rule(fences=st.booleans())
    def broker_fences_after_refusal(self, fences: bool) -> None:
        self.cluster.fences_after_refusal = fences

    @rule(lands=st.booleans())
    def unreported_messages_land(self, lands: bool) -> None:
        self.cluster.zombies_land = lands

    @rule(cut_short=st.booleans())
    def relays_stop_waiting_for_reports_early(self, cut_short: bool) -> None:
        self.cluster.reports_cut_short = cut_short

    @rule(seconds=st.sampled_from([0.5, 3.0, 10.0, 40.0]))
    def time_passes(self, seconds: float) -> None:
        with self.lock:
            self.clock.now += seconds
            self.cluster.resolve_zombies()

    # -------------------------------------------------------------- relays

    @rule(index=st.sampled_from([0, 1]), cycles=st.integers(1, 4))
    def relay_cycles(self, index: int, cycles: int) -> None:
        relay = self.relays[index][0]
        for _ in range(cycles):
            relay.cycle()

    @rule(index=st.sampled_from([0, 1]))
    def relay_drains(self, index: int) -> None:
        self.relays[index][0].drain()

    @rule(index=st.sampled_from([0, 1]))
    def record_fails_once(self, index: int) -> None:
        self.relays[index][1].flaky_records += 1

    @rule(index=st.sampled_from([0, 1]))
    def relay_killed_before_its_record(self, index: int) -> None:
        relay, database, _ = self.relays[index]
        database.kill_before_record = True
        with contextlib.suppress(Killed):
            relay.cycle()
        database.killed = True
        self._replace(index)

    @rule(index=st.sampled_from([0, 1]))
    def relay_stops_while_the_database_is_down(self, index: int) -> None:
        """The relay drains; the database goes away for its records; the relay is
        asked to stop while a record is being retried, and ends."""
        relay, database, _ = self.relays[index]
        database.down = True
        errors: list[BaseException] = []

        def drain() -> None:
            try:
                relay.drain()
            except BaseException as exc:
                errors.append(exc)

        draining = threading.Thread(target=drain)
        draining.start()
        failed = 0
        while draining.is_alive() and failed < 5:
            # A few failed attempts: the loop is waiting for this record by now.
            failed += database.failures.acquire(timeout=0.05)
        relay.stop()
        draining.join(timeout=30)
        assert not draining.is_alive(), "the relay did not stop"
        assert not errors, errors
        database.killed = True
        self._replace(index)

    # -------------------------------------------------------------- operators

    @rule(pick=st.integers(0, 50))
    def operator_requeues_a_discarded_event(self, pick: int) -> None:
        with self.lock:
            discarded = [e for e in self.store.events() if e.status == EventStatus.DISCARDED]
            if discarded:
                self.store.requeue([discarded[pick % len(discarded)].event_id])

    @rule()
    def operator_unparks_every_key(self) -> None:
        with self.lock:
            self.store.unpark(self.store.parked_keys())

    @rule()
    def retention_purges_what_is_done(self) -> None:
        with self.lock:
            self.store.purge(delivered_seconds=0.0, discarded_seconds=1e9, batch=1000)

    # -------------------------------------------------------------- at the end

    def teardown(self) -> None:
        """Every fault healed, time past every lease: each committed event ends
        delivered, or discarded for a reason of its own."""
        try:
            if self.violations:
                return
            for topic in TOPICS:
                self.cluster.weather[topic] = "ok"
            self.cluster.reports_cut_short = False
            for _, database, _ in self.relays:
                database.flaky_records = 0
            relay = self.relays[0][0]
            for _ in range(20):
                with self.lock:
                    self.store.unpark(self.store.parked_keys())
                    self.clock.now += LEASE_SECONDS + 1
                    self.cluster.resolve_zombies(all_of_them=True)
                relay.drain()
                if not any(e.status == EventStatus.PENDING for e in self.store.events()):
                    break
            self.promises_hold()
            stuck = [
                (self.written[e.event_id].key, self.written[e.event_id].order)
                for e in self.store.events()
                if e.status == EventStatus.PENDING
            ]
            assert not stuck, f"never delivered nor discarded: {stuck}"
            landed = {event_id for event_id, _ in self.cluster.log}
            for stored in self.store.events():
                if stored.status == EventStatus.DELIVERED:
                    assert stored.event_id in landed, f"recorded delivered, never landed: {stored}"
        finally:
            relay_loop.wait_exponential_jitter = self._wait  # type: ignore[assignment]
            for relay, _, _ in self.relays:
                relay.abandon()


RelayModel.TestCase.settings = model_settings()
TestRelayModel = RelayModel.TestCase
