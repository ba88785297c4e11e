"""Operators, relays and writers at once: requeue, unpark and purge while relays drain.

Two writers commit events on overlapping keys; two relay processes (parking
keys after a discard, purging with a retention of seconds) publish them; one
relay is killed with SIGKILL now and then; an operator loop requeues
discarded events (by id, by key, by time range), unparks keys and purges.
Some events fail for real: a topic that does not exist until half way, and
events over the relay's message size limit. At the end the consistency check
finds nothing, every committed event is delivered or discarded with a reason,
each key's events, by first copy, reach each topic in the order their
transactions committed (except for events an unpark deliberately skipped),
across the restarts of keys whose counters retention deleted, and Kafka holds
nothing that was never committed.
"""

from __future__ import annotations

import random
import threading
import time
import uuid
from collections import defaultdict
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import sqlalchemy as sa

from outbox_kafka import Event, Outbox
from outbox_kafka.errors import InvalidSelection
from outbox_kafka.operations import Selection, check_consistency, purge, requeue, unpark
from tests.relay_support import TopicReader, rows, wait_until
from tests.reliability.harness import (
    WRITER_COMMIT_ORDER,
    RelayProcess,
    commit_order_violations,
    create_topic,
    take_commit_places,
)
from tests.reliability.report import Row, record, size

RELAY = (
    "--lease-seconds", "4", "--delivery-timeout-ms", "2000", "--batch-size", "200",
    "--on-exhausted", "park", "--max-attempts", "3",
    "--kafka-config", "message.max.bytes=16384",
    "--retain-delivered-days", "0.00003", "--retain-discarded-days", "0.00003",
    "--purge-interval", "2",
)  # fmt: skip

#: Deleted rows are kept here by a trigger, so the audit still sees purged events.
ARCHIVE = [
    "CREATE TABLE outbox_purged (LIKE outbox)",
    "CREATE FUNCTION outbox_keep_purged() RETURNS trigger LANGUAGE plpgsql AS $$ "
    "BEGIN INSERT INTO outbox_purged SELECT OLD.*; RETURN OLD; END $$",
    "CREATE TRIGGER outbox_keep_purged AFTER DELETE ON outbox "
    "FOR EACH ROW EXECUTE FUNCTION outbox_keep_purged()",
]


class MixedWriter(threading.Thread):
    """Commits events in small transactions: most to ``main``, some to ``late`` (a
    topic created later), some over the relay's size limit; notes each event's
    place in its key's commit order."""

    def __init__(self, engine: sa.Engine, keys: list[str], total: int, topics: tuple[str, str]):
        super().__init__(daemon=True)
        self.engine, self.keys, self.total, self.topics = engine, keys, total, topics
        self.committed: list[str] = []
        #: Event id: its place in its key's commit order, across both writers.
        self.places: dict[str, int] = {}
        self.rng = random.Random(uuid.uuid4().int)
        self.error: BaseException | None = None

    def run(self) -> None:
        outbox = Outbox(allow_unknown_types=True)
        main, late = self.topics
        try:
            while len(self.committed) < self.total:
                events = []
                for _ in range(min(5, self.total - len(self.committed))):
                    roll = self.rng.random()
                    topic = late if roll < 0.04 else main
                    filler = "x" * 20_000 if 0.04 <= roll < 0.07 else ""
                    data = {"n": len(self.committed), "filler": filler}
                    events.append(
                        Event(type="ops.e", key=self.rng.choice(self.keys), data=data, topic=topic)
                    )
                with self.engine.begin() as conn:
                    places = take_commit_places(conn, [e.key for e in events])
                    ids = [str(i) for i in outbox.enqueue_many(conn, events)]
                self.committed.extend(ids)
                self.places.update(zip(ids, places, strict=True))
                time.sleep(self.rng.uniform(0.0, 0.02))
        except BaseException as exc:
            self.error = exc


class Operator(threading.Thread):
    """Requeues, unparks and purges at random until stopped; remembers what unpark skipped."""

    def __init__(self, engine: sa.Engine, started: datetime) -> None:
        super().__init__(daemon=True)
        self.engine, self.started = engine, started
        self.rng = random.Random(uuid.uuid4().int)
        self.done: dict[str, int] = defaultdict(int)
        #: Events an unpark let their key go on without; they may arrive out of order.
        self.skipped: set[str] = set()
        self.halt = threading.Event()
        self.error: BaseException | None = None
        #: What check --consistency found on the live outbox, while everything ran.
        self.violations: list[str] = []

    def discarded(self) -> list[tuple[str, str]]:
        return [
            (r[0], r[1])
            for r in rows(
                self.engine,
                "SELECT CAST(event_id AS text), ordering_key FROM outbox "
                "WHERE status = 'discarded' LIMIT 50",
            )
        ]

    def unpark_all(self) -> None:
        result = unpark(self.engine, Selection(everything=True))
        self.skipped |= {k.event.event_id for k in result.keys if k.event is not None}
        self.done["unpark"] += result.count

    def step(self) -> None:
        action = self.rng.choice(["by_id", "by_key", "by_time", "unpark", "purge", "check"])
        found = self.discarded()
        try:
            if action == "by_id" and found:
                event_id, _ = self.rng.choice(found)
                self.done[action] += requeue(self.engine, Selection(event_ids=(event_id,))).count
            elif action == "by_key" and found:
                _, key = self.rng.choice(found)
                self.done[action] += requeue(self.engine, Selection(keys=(key,))).count
            elif action == "by_time":
                since = self.started + timedelta(seconds=self.rng.uniform(0, 5))
                until = since + timedelta(seconds=self.rng.uniform(1, 10))
                self.done[action] += requeue(self.engine, Selection(since=since, until=until)).count
            elif action == "unpark" and self.rng.random() < 0.3:
                self.unpark_all()
            elif action == "check":
                report = check_consistency(self.engine)
                self.violations += [f"{v.check} {v.key} {v.event_id}" for v in report.violations]
                self.done[action] += 1
            elif action == "purge":
                result = purge(self.engine, retain_delivered_seconds=1, retain_discarded_seconds=1)
                self.done[action] += result.delivered + result.discarded
        except InvalidSelection:
            # A selection holding events of a parked key but not the one that parked it.
            self.done["refused"] += 1

    def run(self) -> None:
        try:
            while not self.halt.wait(self.rng.uniform(0.05, 0.3)):
                self.step()
        except BaseException as exc:
            self.error = exc


def test_operators_relays_and_writers_at_once(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    per_writer = size(600, 8_000)
    keys = [f"k{i:03d}" for i in range(size(30, 200))]
    kills = size(2, 6)
    main, late = new_topic(4), f"late-{uuid.uuid4().hex[:12]}"
    with engine.begin() as conn:
        for statement in [*ARCHIVE, WRITER_COMMIT_ORDER]:
            conn.execute(sa.text(statement))

    relays = [
        RelayProcess(database_url, kafka_bootstrap, tmp_path, name, *RELAY, metrics=False)
        for name in ("relay-a", "relay-b")
    ]
    writers = [MixedWriter(engine, keys, per_writer, (main, late)) for _ in range(2)]
    operator = Operator(engine, datetime.now(UTC) - timedelta(seconds=1))
    rng = random.Random(uuid.uuid4().int)

    def explain() -> str:
        summary = rows(engine, "SELECT status, count(*) FROM outbox GROUP BY 1")
        return f"{summary}\noperator: {dict(operator.done)}\n{relays[1].log()[-2000:]}"

    try:
        for relay in relays:
            relay.start()
        for writer in writers:
            writer.start()
        operator.start()
        for n in range(kills):
            time.sleep(rng.uniform(1.0, 3.0))
            relays[1].kill()
            relays[1].start()
            if n == kills // 2:
                create_topic(kafka_bootstrap, late, 2)
        for writer in writers:
            writer.join(600)
            assert writer.error is None, writer.error
        if late not in _topics(kafka_bootstrap):
            create_topic(kafka_bootstrap, late, 2)
        operator.halt.set()
        operator.join(60)
        assert operator.error is None, operator.error
        assert operator.done["check"] > 0
        assert not operator.violations, operator.violations[:10]

        # Afterwards, a last requeue of everything discarded (the late topic exists
        # now), then unpark until nothing is pending.
        requeue(engine, Selection(everything=True))
        wait_until(
            lambda: _settle(operator), size(120, 900), interval=1.0, what="nothing pending",
            explain=explain,
        )  # fmt: skip
    finally:
        operator.halt.set()
        codes = [relay.stop() for relay in relays]
    assert codes == [0, 0], explain()

    consistency = check_consistency(engine)
    assert consistency.ok, consistency.violations

    committed = {i for w in writers for i in w.committed}
    final = {
        r[0]: r
        for r in rows(
            engine,
            "SELECT CAST(event_id AS text), ordering_key, seq, status, last_error, topic "
            "FROM outbox UNION ALL "
            "SELECT CAST(event_id AS text), ordering_key, seq, status, last_error, topic "
            "FROM outbox_purged",
        )
    }
    assert committed <= set(final), "committed events missing from the outbox and the archive"
    seen = {topic: _read(kafka_bootstrap, topic, final) for topic in (main, late)}
    in_kafka = {event_id for records in seen.values() for event_id, _ in records}
    phantoms = in_kafka - committed
    lost = [
        i for i in committed if not (i in in_kafka or (final[i][3] == "discarded" and final[i][4]))
    ]
    # By the writers' commit order, not by sequence number: retention deletes the
    # counters of idle keys, and such a key numbers its next events from 1 again.
    places = {i: n for w in writers for i, n in w.places.items()}
    violations = [
        v
        for records in seen.values()
        for v in commit_order_violations(records, places, ignore=operator.skipped)
    ]
    discarded = sum(1 for i in committed if i not in in_kafka)
    # Keys that started again at 1 after retention deleted their counter.
    restarts = sum(1 for i in committed if final[i][2] == 1) - len({final[i][1] for i in committed})
    duplicated = sum(len(r) for r in seen.values()) - len(in_kafka)

    assert not phantoms, f"in Kafka but never committed: {sorted(phantoms)[:5]}"
    assert not lost, f"neither delivered nor discarded with a reason: {lost[:5]}\n{explain()}"
    assert not violations, violations[:10]
    assert operator.done["by_id"] + operator.done["by_key"] + operator.done["by_time"] > 0
    assert operator.done["purge"] > 0
    record(
        Row(
            scenario="operators at work",
            enqueued=len(committed),
            delivered=len(in_kafka),
            lost=len(lost),
            duplicated=duplicated,
            order_violations=len(violations),
            recover_seconds=None,
            note=f"2 writers, 2 relays, {kills} SIGKILLs; operator: "
            + ", ".join(f"{n} {what}" for what, n in sorted(operator.done.items()))
            + f"; {discarded} discarded (over the size limit), 0 stranded; "
            f"{restarts} counter restarts",
        )
    )


def _topics(bootstrap: str) -> set[str]:
    from confluent_kafka.admin import AdminClient

    return set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics)


def _settle(operator: Operator) -> bool:
    """Unpark what is parked; True once nothing is pending."""
    operator.unpark_all()
    left = rows(operator.engine, "SELECT count(*) FROM outbox WHERE status = 'pending'")
    return int(left[0][0]) == 0


def _read(
    bootstrap: str, topic: str, final: dict[str, tuple[object, ...]]
) -> list[tuple[str, str]]:
    """(event id, key) of every record of ``topic``, in partition and offset order."""
    expected = {i for i, r in final.items() if r[5] == topic and r[3] == "delivered"}
    reader = TopicReader(bootstrap, topic, timeout=60)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not expected <= {r.event_id for r in reader.records}:
            reader.poll(0.5)
        while reader.poll(1.5):
            pass
        records = sorted(reader.records, key=lambda r: (r.partition, r.offset))
    finally:
        reader.close()
    return [(r.event_id, r.key or "") for r in records]
