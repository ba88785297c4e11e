"""Exactly once across crashes, with relay processes killed where it hurts.

Two relay processes serve one outbox while a writer commits events steadily
and bursts of events keep the relays busy. The relays are killed with
SIGKILL at the moments that leave events on Kafka and pending in the outbox:

- *in flight*: as soon as relay B's metrics show it acknowledged a batch of a
  burst (that batch is being recorded, the next one is being produced);
- *after a record*: as soon as B's metrics show a record of a burst's batch
  committed (the next batch is being produced);
- *the heir*: B is killed in flight and left down; relay A takes B's keys
  over when their leases end and is killed a few milliseconds after its
  claim of them, while it reads Kafka back (its log then has no ``read_back``
  line for them yet), so the next heir reads back two dead sessions;
- *both*: B and A killed within 30 ms of each other, in flight.

After each round, every event written before the kill is delivered before
the next round begins. Nothing may be lost, reordered or sent twice, and the
read-backs must have found messages on Kafka (``action=read_back ...
matched=N`` in the relays' logs: a killed relay's metrics die with it). The
same kills run with retention purging every second, and with events
discarded to a dead-letter topic in the bursts: exactly one copy of each.

A relay frozen (SIGSTOP) past its lease is where exactly once stops: when it
resumes it may still send the requests it had queued. Each freeze may cost at
most one batch of duplicates, and the frozen relay counts every one in
``outbox_acknowledged_unrecorded_total``.
"""

from __future__ import annotations

import itertools
import random
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.relay_support import TcpProxy, outbox_summary, rows, scalar, wait_until
from tests.reliability.harness import (
    WRITER_COMMIT_ORDER,
    Collector,
    RecoveryClock,
    RelayProcess,
    Writer,
    audit,
    check_writer,
    keep_purged,
    log_actions,
)
from tests.reliability.report import size

BATCH = 200
#: The frozen relay's producer puts at most this many messages of a partition in one
#: request (batch.num.messages).
REQUEST_SHARE = 10
LEASE = 4.0
RELAY = (
    "--lease-seconds", str(LEASE), "--delivery-timeout-ms", "2000",
    "--batch-size", str(BATCH), "--log-format", "json",
)  # fmt: skip
#: Retention deleting every delivered event, every second.
PURGING = ("--purge-interval", "1", "--retain-delivered-days", "0")

#: Batches a relay has had acknowledged, and records it has committed (its /metrics).
ACKNOWLEDGED = "outbox_publish_duration_seconds_count"
RECORDED = "outbox_mark_duration_seconds_count"
ACKNOWLEDGED_UNRECORDED = "outbox_acknowledged_unrecorded_total"

#: The steady writer's keys and pace (events/s).
KEYS = [f"key-{i:04d}" for i in range(100)]
STEADY_RATE = 200
#: A burst: one transaction over more keys than a claim takes, so that the relays
#: meet a backlog and send full batches back to back, each reading the next ahead.
BURST_KEYS = [f"key-{i:04d}" for i in range(1000)]
BURST = 3000
#: In-flight rounds added (at most) until a read-back has found an event on Kafka.
EXTRA_ROUNDS = 6
#: Relay B reaches the database through a proxy that holds each answer this long:
#: its records take a few round trips, so a batch Kafka acknowledged stays
#: unrecorded long enough for a kill to land there.
SLOW_DATABASE = 0.02

#: Corrupts every seventh event a writer commits (by its data's "i"): the relay
#: cannot send it and discards it, with a dead-letter copy.
CORRUPT_SOME = [
    "CREATE FUNCTION outbox_corrupt() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
    "IF mod((convert_from(NEW.value, 'UTF8')::jsonb #>> '{data,i}')::bigint, 7) = 3 THEN "
    "NEW.value := convert_to('not json', 'UTF8'); END IF; RETURN NEW; END $$",
    "CREATE TRIGGER outbox_corrupt BEFORE INSERT ON outbox "
    "FOR EACH ROW EXECUTE FUNCTION outbox_corrupt()",
]


@dataclass
class Kill:
    """One round of kills, and what the read-backs after it found."""

    kind: str
    #: Whether the victim was seen busy with a burst when it was killed.
    busy: bool
    #: Where relay A's and relay B's logs were when the round began: the read-backs
    #: logged from there to the next round's marks follow this round's kills.
    marks: tuple[int, int]
    sigkills: int = 1
    read_backs: int = 0
    matched: int = 0
    unproven: int = 0
    #: The heir round: whether the heir had logged its read-back when it was killed.
    heir_read_back_logged: bool | None = None


class Crashes:
    """Two relay processes, a steady writer, bursts, and the kills of one run.

    ``purging``: retention runs (events purged are kept by ``keep_purged``), and
    the writers note commit places. Relay B reaches the database through a proxy
    that holds every answer ``b_database_delay`` seconds, with ``b_options``
    (libpq's ``-c name=value``) if given, and runs with ``b_args`` added.
    """

    def __init__(
        self,
        engine: sa.Engine,
        database_url: str,
        bootstrap: str,
        topic: str,
        log_dir: Path,
        relay_args: Sequence[str],
        *,
        purging: bool = False,
        b_database_delay: float = SLOW_DATABASE,
        b_options: str | None = None,
        b_args: Sequence[str] = (),
    ) -> None:
        self.engine = engine
        self.topic = topic
        self.purging = purging
        url = make_url(database_url)
        #: Relay B's database is slowed through a TCP proxy; a server reached by a
        #: Unix socket (the embedded one) is not, and the kills land where they may.
        self.proxy = (
            TcpProxy(url.port, host=url.host or "127.0.0.1").start()
            if url.port is not None
            else None
        )
        b_url = url
        if self.proxy is not None:
            self.proxy.set_delay(b_database_delay)
            b_url = url.set(port=self.proxy.port)
        if b_options:
            b_url = b_url.update_query_dict({"options": b_options})
        self.a = RelayProcess(database_url, bootstrap, log_dir, "relay-a", *relay_args)
        self.b = RelayProcess(
            b_url.render_as_string(hide_password=False),
            bootstrap,
            log_dir,
            "relay-b",
            *relay_args,
            *b_args,
        )
        self.collector = Collector(bootstrap, topic)
        self.clock = RecoveryClock(engine)
        self.rng = random.Random(uuid.uuid4().int)
        self.steady = Writer(engine, topic, KEYS, 10**9, rate=STEADY_RATE, chunk=10, places=purging)
        self.bursts: list[Writer] = []
        self.kills: list[Kill] = []

    # Running -------------------------------------------------------------------

    def start(self) -> None:
        self.a.start()
        self.b.start()
        self.steady.start()
        for relay in (self.a, self.b):
            self.healthy(relay)

    def finish(self) -> None:
        """Stop writing, wait until everything is delivered and read."""
        self.steady.stop()
        for burst in self.bursts:
            burst.join(120)
        wait_until(
            lambda: self.pending() == 0,
            size(120, 600),
            interval=0.25,
            what="every event delivered",
            explain=self.explain,
        )
        self.collector.catch_up(self.delivered(), 120)
        self.tally()

    def close(self) -> tuple[int, int]:
        self.steady.stop()
        for burst in self.bursts:
            burst.stop()
        codes = (self.a.stop(), self.b.stop())
        self.collector.close()
        if self.proxy is not None:
            self.proxy.close()
        return codes

    def writers(self) -> list[Writer]:
        return [self.steady, *self.bursts]

    def committed(self) -> list[str]:
        return [i for w in self.writers() for i in w.committed]

    def commit_places(self) -> dict[str, int]:
        return {i: place for w in self.writers() for i, place in w.places.items()}

    def delivered(self) -> set[str]:
        source = "SELECT CAST(event_id AS text) FROM outbox WHERE status = 'delivered'"
        if self.purging:
            source += (
                " UNION ALL SELECT CAST(event_id AS text) FROM outbox_purged "
                "WHERE status = 'delivered'"
            )
        return {str(r[0]) for r in rows(self.engine, source)}

    def pending(self) -> int:
        return int(scalar(self.engine, "SELECT count(*) FROM outbox WHERE status = 'pending'"))

    def now(self) -> Any:
        """The database's clock."""
        return scalar(self.engine, "SELECT clock_timestamp()")

    def explain(self) -> str:
        return (
            f"{outbox_summary(self.engine)}\nkills: {self.kills}\n"
            f"--- relay a log tail:\n{self.a.log()[-3000:]}\n"
            f"--- relay b log tail:\n{self.b.log()[-3000:]}"
        )

    def healthy(self, relay: RelayProcess) -> None:
        wait_until(
            lambda: relay.get("/healthz")[0] == 200,
            60,
            interval=0.05,
            what=f"{relay.log_path.stem} healthy",
            explain=self.explain,
        )

    def burst(self) -> Writer:
        """A burst of events over every key, in one transaction."""
        writer = Writer(
            self.engine,
            self.topic,
            BURST_KEYS,
            BURST,
            rate=100_000,
            chunk=BURST,
            places=self.purging,
        )
        self.bursts.append(writer.start())
        return writer

    def settled(self, fault: Any, timeout: float = 60) -> None:
        """Wait until every event written before ``fault`` (the database's clock) is
        delivered: whatever the fault left is taken over, read back and sent."""
        wait_until(
            lambda: (
                int(
                    scalar(
                        self.engine,
                        "SELECT count(*) FROM outbox WHERE status = 'pending' AND created_at < :at",
                        at=fault,
                    )
                )
                == 0
            ),
            timeout,
            interval=0.1,
            what="the events written before the fault delivered",
            explain=self.explain,
        )

    # Moments -------------------------------------------------------------------

    def rises(self, relay: RelayProcess, metric: str, timeout: float = 10) -> bool:
        """Wait until ``metric`` of ``relay`` rises above its value now; False if it did not."""
        before = relay.metric(metric) or 0.0
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            now = relay.metric(metric)
            if now is not None and now > before:
                return True
        return False

    def busy_with_a_burst(self, relay: RelayProcess, tries: int = 3) -> bool:
        """Commit a burst and wait until ``relay`` has had a batch acknowledged since: it
        is busy with the burst, for a couple of hundred milliseconds. The other relay
        may take a whole burst before ``relay`` acknowledges one of its batches (on a
        busy machine, or while ``relay`` reads back what its last life left): then
        another burst is committed, up to ``tries`` in all."""
        self.healthy(relay)
        for _ in range(tries):
            self.burst().join(60)
            if self.rises(relay, ACKNOWLEDGED):
                return True
        return False

    def marks(self) -> tuple[int, int]:
        return len(self.a.log()), len(self.b.log())

    # Rounds --------------------------------------------------------------------

    def round(self, kind: str) -> Kill:
        marks = self.marks()
        if kind == "in flight":
            kill = Kill(kind, self.busy_with_a_burst(self.b), marks)
            time.sleep(self.rng.uniform(0, 0.02))
            self.b.kill()
            self.b.start()
        elif kind == "after a record":
            kill = Kill(kind, self.busy_with_a_burst(self.b), marks)
            kill.busy = kill.busy and self.rises(self.b, RECORDED)
            time.sleep(self.rng.uniform(0, 0.01))
            self.b.kill()
            self.b.start()
        elif kind == "the heir":
            kill = self._heir_round(marks)
        elif kind == "both":
            kill = Kill(kind, self.busy_with_a_burst(self.b), marks, sigkills=2)
            gap = self.rng.uniform(0, 0.03)
            self.b.kill(wait=False)
            time.sleep(gap)
            self.a.kill(wait=False)
            self.b.wait_killed()
            self.a.wait_killed()
            self.a.start()
            self.b.start()
        else:
            raise AssertionError(kind)
        fault = self.now()
        self.clock.fault_ended()
        self.kills.append(kill)
        self.settled(fault)
        self.collector.read(0.2)
        return kill

    def _heir_round(self, marks: tuple[int, int]) -> Kill:
        kill = Kill("the heir", True, marks, sigkills=0)
        for _ in range(5):
            kill.busy = kill.busy and self.busy_with_a_burst(self.b)
            self.b.kill()
            kill.sigkills += 1
            # B's claims outlive it until their leases end; A's own last milliseconds.
            first = self._claims()
            time.sleep(0.3)
            dead = first & self._claims()
            if dead:
                break
            # Killed with no claim committed: nothing to inherit; again.
            fault = self.now()
            self.b.start()
            self.settled(fault)
        if dead:
            keys = sorted({key for key, _ in dead})
            tokens = sorted({token for _, token in dead})
            logged: list[int] = []

            def taken_over() -> bool:
                # The heir's claim puts the key in doubt, in the claim's transaction.
                logged.append(len(self.a.log()))
                return bool(
                    scalar(
                        self.engine,
                        "SELECT count(*) FROM outbox_keys WHERE ordering_key = ANY(:keys) "
                        "AND claim_token IS NOT NULL AND doubt_sessions IS NOT NULL "
                        "AND CAST(claim_token AS text) <> ALL(:tokens)",
                        keys=keys,
                        tokens=tokens,
                    )
                )

            wait_until(
                taken_over,
                LEASE + 10,
                interval=0.002,
                what="relay a taking relay b's keys over",
                explain=self.explain,
            )
            time.sleep(self.rng.uniform(0, 0.03))
            self.a.kill()
            kill.sigkills += 1
            kill.heir_read_back_logged = bool(self.a.actions("read_back", since=logged[-1]))
            self.a.start()
        self.b.start()
        return kill

    def _claims(self) -> set[tuple[str, str]]:
        return {
            (r[0], r[1])
            for r in rows(
                self.engine,
                "SELECT ordering_key, CAST(claim_token AS text) FROM outbox_keys "
                "WHERE claim_token IS NOT NULL AND lease_expires_at > now()",
            )
        }

    # The report ----------------------------------------------------------------

    def tally(self) -> None:
        """What the read-backs logged after each round's kills, up to the next round."""
        if not self.kills:
            return
        a_log, b_log = self.a.log(), self.b.log()
        ends = [k.marks for k in self.kills[1:]] + [(len(a_log), len(b_log))]
        for kill, end in zip(self.kills, ends, strict=True):
            reads = log_actions(a_log[kill.marks[0] : end[0]], "read_back") + log_actions(
                b_log[kill.marks[1] : end[1]], "read_back"
            )
            kill.read_backs = len(reads)
            kill.matched = sum(int(r["matched"]) for r in reads)
            kill.unproven = sum(int(r["unproven"]) for r in reads)

    def matched(self) -> int:
        self.tally()
        return sum(k.matched for k in self.kills)

    def summary(self) -> str:
        kinds: dict[str, list[Kill]] = {}
        for k in self.kills:
            kinds.setdefault(k.kind, []).append(k)
        heirs = [k.heir_read_back_logged for k in self.kills if k.kind == "the heir"]
        during = sum(1 for h in heirs if h is False)
        return (
            f"2 relays, {sum(k.sigkills for k in self.kills)} SIGKILLs in "
            f"{len(self.kills)} rounds ("
            + "; ".join(
                f"{kind}: {len(ks)}, {sum(1 for k in ks if k.matched)} with events found "
                f"on Kafka by the read-back"
                for kind, ks in kinds.items()
            )
            + f"); {sum(k.read_backs for k in self.kills)} read-backs, "
            f"matched={self.matched()}, "
            f"{sum(k.unproven for k in self.kills)} keys unproven for a while"
            + (
                f"; heir killed before its read-back ended: {during} of {len(heirs)}"
                if heirs
                else ""
            )
        )


def kill_rounds(crashes: Crashes, kinds: Sequence[str], rounds: int) -> None:
    """``rounds`` of each of ``kinds``; then more in flight (up to EXTRA_ROUNDS) until
    a read-back has found an event on Kafka."""
    for kind in [k for _ in range(rounds) for k in kinds]:
        crashes.round(kind)
    for _ in range(EXTRA_ROUNDS):
        if crashes.matched():
            break
        crashes.round("in flight")


def assert_found_on_kafka(crashes: Crashes) -> None:
    if crashes.proxy is not None:  # without the slow database the window is narrow
        assert crashes.matched() > 0, f"no read-back found anything: {crashes.kills}"
    assert all(k.busy for k in crashes.kills), crashes.kills


def run(crashes: Crashes, body: Callable[[Crashes], None]) -> Crashes:
    """Start, run ``body``, deliver everything, stop; every relay exits 0 and every
    commit a writer saw is in the outbox."""
    try:
        crashes.start()
        body(crashes)
        crashes.finish()
    finally:
        codes = crashes.close()
    assert codes == (0, 0), crashes.explain()
    for writer in crashes.writers():
        check_writer(crashes.engine, writer, purged=crashes.purging)
    return crashes


# --------------------------------------------------------------------------- the scenarios


def test_sigkills_in_flight_after_a_record_of_the_heir_and_of_both_send_nothing_twice(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = new_topic(6)
    kinds = ["in flight", "after a record", "the heir", "both"]
    crashes = Crashes(engine, database_url, kafka_bootstrap, topic, tmp_path, RELAY)
    run(crashes, lambda c: kill_rounds(c, kinds, size(1, 3)))

    result = audit(engine, crashes.collector.generations)
    result.assert_clean()
    assert result.enqueued == len(crashes.committed())
    assert_found_on_kafka(crashes)
    heirs = [k for k in crashes.kills if k.kind == "the heir"]
    assert heirs and all(k.heir_read_back_logged is not None for k in heirs), heirs
    result.row("exactly once: SIGKILL matrix", crashes.clock.worst(), crashes.summary())


def test_sigkills_with_retention_purging_every_second_send_nothing_twice(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = new_topic(6)
    keep_purged(engine)
    with engine.begin() as conn:
        conn.exec_driver_sql(WRITER_COMMIT_ORDER)
    kinds = ["in flight", "after a record", "both"]
    crashes = Crashes(
        engine,
        database_url,
        kafka_bootstrap,
        topic,
        tmp_path,
        (*RELAY, *PURGING),
        purging=True,
    )
    run(crashes, lambda c: kill_rounds(c, kinds, size(1, 4)))

    result = audit(
        engine, crashes.collector.generations, purged=True, places=crashes.commit_places()
    )
    result.assert_clean()
    assert result.enqueued == len(crashes.committed())
    assert_found_on_kafka(crashes)
    purged = sum(
        int(p["events"]) for relay in (crashes.a, crashes.b) for p in relay.actions("purge")
    )
    assert purged > 0
    # Keys whose counter retention deleted start again at 1.
    restarts = int(
        scalar(
            engine,
            "SELECT count(*) - count(DISTINCT ordering_key) FROM ("
            "SELECT ordering_key FROM outbox WHERE seq = 1 UNION ALL "
            "SELECT ordering_key FROM outbox_purged WHERE seq = 1) s",
        )
    )
    result.row(
        "exactly once: SIGKILLs, purging every second",
        crashes.clock.worst(),
        f"{crashes.summary()}; {purged:,} events purged, {restarts} counter restarts",
    )


def test_dead_letter_copies_in_flight_at_a_sigkill_are_made_once(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic, dead_letters = new_topic(6), new_topic(2, prefix="dlt")
    with engine.begin() as conn:
        for statement in CORRUPT_SOME:
            conn.execute(sa.text(statement))
    relay = (*RELAY, "--dead-letter-topic", dead_letters)
    crashes = Crashes(engine, database_url, kafka_bootstrap, topic, tmp_path, relay)
    copies = Collector(kafka_bootstrap, dead_letters)
    try:
        run(crashes, lambda c: kill_rounds(c, ["in flight"], size(3, 10)))
        discarded = {
            r[0]: bytes(r[1])
            for r in rows(
                engine,
                "SELECT CAST(event_id AS text), value FROM outbox WHERE status = 'discarded'",
            )
        }
        copies.catch_up(set(discarded), 60)
    finally:
        copies.close()

    result = audit(engine, crashes.collector.generations, discarded=True)
    result.assert_clean()
    assert result.enqueued == len(crashes.committed())
    assert discarded and set(discarded.values()) == {b"not json"}
    made = Counter(r.event_id for g in copies.generations for r in g)
    assert set(made) == set(discarded), (set(made) ^ set(discarded), crashes.explain())
    twice = {i: n for i, n in made.items() if n > 1}
    assert not twice, f"dead-letter copies made more than once: {list(twice.items())[:5]}"
    assert all(r.raw == discarded[r.event_id] for g in copies.generations for r in g)
    assert_found_on_kafka(crashes)
    result.row(
        "exactly once: dead-letter copies at SIGKILLs",
        crashes.clock.worst(),
        f"{crashes.summary()}; {len(discarded):,} events discarded, one dead-letter copy each",
    )


@dataclass
class Freeze:
    """One SIGSTOP of relay B past its lease, and what it cost."""

    busy: bool
    #: Whether B was frozen inside a database transaction.
    in_transaction: bool
    duplicates: int
    #: The fewest record batches the freeze's duplicates fill on one partition (runs
    #: of consecutive offsets, each at most one request's share of a partition). Above
    #: 1, they came in more than one request.
    record_batches: int
    #: B's outbox_acknowledged_unrecorded_total after the freeze, less before it.
    acknowledged_unrecorded: int
    #: The events of B's acknowledged_unrecorded log lines after the freeze.
    logged: int


def test_a_relay_frozen_past_its_lease_sends_at_most_one_batch_twice_and_counts_it(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = new_topic(6)
    freezes: list[Freeze] = []
    # A relay frozen inside a transaction would hold its keys' rows locked until it
    # resumes: the server ends such a session after 2 s, so A can take them over.
    # B's producer sends a batch in many requests (at most 10 messages a partition
    # each), one at a time: a freeze while it sends leaves requests queued, to be
    # sent on waking. (With one request per batch, the window between the flush
    # and the request on the wire is well under a millisecond.)
    crashes = Crashes(
        engine,
        database_url,
        kafka_bootstrap,
        topic,
        tmp_path,
        RELAY,
        b_database_delay=0,
        b_options="-c idle_in_transaction_session_timeout=2000",
        b_args=(
            "--kafka-config",
            "max.in.flight.requests.per.connection=1",
            "--kafka-config",
            f"batch.num.messages={REQUEST_SHARE}",
        ),
    )

    def copies() -> set[tuple[int, int]]:
        """Where every copy after an event's first lies on the topic: (partition, offset)."""
        seen: set[str] = set()
        found: set[tuple[int, int]] = set()
        records = [r for g in crashes.collector.generations for r in g]
        for r in sorted(records, key=lambda r: (r.partition, r.offset)):
            if r.event_id in seen:
                found.add((r.partition, r.offset))
            seen.add(r.event_id)
        return found

    def record_batches(new: set[tuple[int, int]]) -> int:
        """The fewest record batches that hold ``new`` on the partition that needs the
        most: runs of consecutive offsets, each at most REQUEST_SHARE long (one
        request's share of a partition)."""
        most = 0
        for partition in {p for p, _ in new}:
            offsets = sorted(o for p, o in new if p == partition)
            runs, length = 1, 1
            for before, after in itertools.pairwise(offsets):
                if after == before + 1 and length < REQUEST_SHARE:
                    length += 1
                else:
                    runs, length = runs + 1, 1
            most = max(most, runs)
        return most

    def freeze_rounds(crashes: Crashes) -> None:
        b = crashes.b
        for _ in range(size(3, 20)):
            crashes.collector.read(0.5)
            before = copies()
            counted = b.metric(ACKNOWLEDGED_UNRECORDED)
            assert counted is not None, crashes.explain()
            # Frozen while it sends the batch after an acknowledged one, one request
            # at a time: the requests not sent yet wait in the producer's queue.
            busy = crashes.busy_with_a_burst(b)
            time.sleep(crashes.rng.uniform(0.005, 0.05))
            b.freeze()
            frozen_at = crashes.now()
            time.sleep(0.5)
            in_transaction = bool(
                scalar(
                    engine,
                    "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state = 'idle in transaction' "
                    "AND state_change < clock_timestamp() - interval '0.4 seconds'",
                )
            )
            # A takes B's keys over once their leases end, and sends their events.
            time.sleep(LEASE)
            crashes.settled(frozen_at)
            mark = len(b.log())
            b.thaw()
            thawed_at = crashes.now()
            crashes.clock.fault_ended()
            crashes.healthy(b)
            crashes.settled(thawed_at)
            crashes.collector.read(1.5)
            now = b.metric(ACKNOWLEDGED_UNRECORDED)
            assert now is not None, crashes.explain()
            logged = b.actions("acknowledged_unrecorded", since=mark)
            new = copies() - before
            freezes.append(
                Freeze(
                    busy,
                    in_transaction,
                    len(new),
                    record_batches(new),
                    int(now - counted),
                    sum(int(r["events"]) for r in logged),
                )
            )

    run(crashes, freeze_rounds)
    result = audit(engine, crashes.collector.generations)
    result.assert_clean(duplicates=True)
    assert result.enqueued == len(crashes.committed())
    assert result.duplicated == sum(f.duplicates for f in freezes), freezes
    for freeze in freezes:
        assert freeze.duplicates <= BATCH, freezes
        assert freeze.duplicates <= freeze.acknowledged_unrecorded, freezes
        assert freeze.logged == freeze.acknowledged_unrecorded, freezes
    assert all(f.busy for f in freezes), freezes
    costly = [f.duplicates for f in freezes if f.duplicates]
    counted = [f.acknowledged_unrecorded for f in freezes]
    result.row(
        "exactly once stops: a relay frozen past its lease",
        crashes.clock.worst(),
        f"{len(freezes)} SIGSTOPs of a busy relay for {LEASE + 0.5:g} s "
        f"({sum(f.in_transaction for f in freezes)} inside a transaction), "
        f"{len(costly)} with duplicates ({', '.join(map(str, costly)) or 'none'}; "
        f"batch {BATCH}; one freeze's filled at least "
        f"{max(f.record_batches for f in freezes)} record batch(es) of {REQUEST_SHARE} "
        "on one partition); "
        f"acknowledged unrecorded per freeze: {counted}",
    )
