"""What a takeover costs: a relay killed at full rate, its keys read back by the heir.

Two ``outbox-kafka relay`` processes (run mode, ``--lease-seconds`` of
:data:`LEASE_SECONDS`) drain a backlog filled on the server (:data:`EVENTS`
of 200 B over ``EVENTS / 10`` keys) to a fresh topic. Once the two have
published :data:`KILL_AT` of it together, relay A gets SIGKILL. Relay B goes on
at full rate, and when the dead relay's leases end it takes its keys over: they
are in doubt, so it reads their partitions back from A's floors to the end,
records what it finds there as delivered and sends only the rest. Everything
B sent in the meantime lies on those partitions too, so the read-back reads
roughly one lease of the relay's output.

Whether events were still pending when A's first lease ended (relay B busy
at the takeover) is reported with B's rate.

Per run:

* ``takeover → first record``: for each key A held when it died, from the
  end of its lease (``lease_expires_at`` of the keys still claimed under
  the same token :data:`CLAIMS_APART` seconds after the kill) to the
  first of its events recorded delivered again (``delivered_at``): the wait
  for the read-back plus one send. Median and worst over the keys;
* ``messages read per takeover``: B's ``outbox_read_back_messages_total``
  over the run (every read-back of the dead relay's keys), with the
  read-backs' seconds and how many events they matched.

The run fails if an event is lost, left pending, or sent twice (a consumer
reads the topic back and checks every committed event is on it once).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import statistics
import time
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from datetime import datetime

from confluent_kafka import Consumer, KafkaError
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import text

from outbox_kafka import Outbox

from .broker import PARTITIONS, Kafka
from .common import BenchContext, Result, load_average
from .processes import RelayProcess
from .producer import ROUTES, SCHEMA_DIR
from .tables import ServerFill, Table

NAME = "takeover"
#: The relays' lease (their default).
LEASE_SECONDS = 30.0
QUICK_LEASE_SECONDS = 15.0
#: The backlog: enough that relay B is still at full rate when the leases end.
EVENTS = 600_000
QUICK_EVENTS = 100_000
EVENTS_PER_KEY = 10
#: Relay A is killed once this share of the backlog is published.
KILL_AT = 0.2
#: Longest a run may take after the kill.
RUN_TIMEOUT = 600.0

#: Keys claimed now, with their claim tokens and lease ends: those still claimed
#: under the same token seconds after the kill are the dead relay's (relay B's
#: claims are recorded and cleared within a fraction of a second).
CLAIMS = """
    SELECT ordering_key, CAST(claim_token AS text), lease_expires_at FROM {keys}
    WHERE claim_token IS NOT NULL AND lease_expires_at > now()
"""
#: Seconds between the two looks at the claims.
CLAIMS_APART = 3.0
#: For each of those keys, from its lease end to its first event recorded again.
FIRST_RECORDS = """
    SELECT EXTRACT(EPOCH FROM min(e.delivered_at) - k.lease_end)
    FROM {events} e
    JOIN unnest(CAST(:keys AS text[]), CAST(:ends AS timestamptz[])) AS k(key, lease_end)
      ON e.ordering_key = k.key
    WHERE e.status = 'delivered' AND e.delivered_at >= k.lease_end
    GROUP BY k.key, k.lease_end
"""
ALL_IDS = "SELECT CAST(event_id AS text) FROM {events}"

READ_BACK_METRICS = (
    "outbox_read_backs_total",
    "outbox_read_back_messages_total",
    "outbox_read_back_matched_total",
    "outbox_read_back_unproven_total",
    "outbox_read_back_seconds_sum",
)


@dataclass(frozen=True)
class Takeover:
    dead_keys: int
    first_record_median: float
    first_record_worst: float
    read_backs: int
    messages_read: int
    matched: int
    unproven: int
    read_back_seconds: float
    #: B's events/s from the kill to the first lease end.
    rate: float
    #: Whether events were still pending when the first lease ended: B was busy.
    busy: bool


def metrics(relay: RelayProcess) -> dict[str, float]:
    """The relay's samples of :data:`READ_BACK_METRICS`, summed over labels."""
    url = f"http://127.0.0.1:{relay.metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        body = response.read().decode()
    found: dict[str, float] = defaultdict(float)
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            if sample.name in READ_BACK_METRICS:
                found[sample.name] += sample.value
    return dict(found)


def published(relay: RelayProcess) -> int:
    """Events Kafka acknowledged to ``relay``; 0 until it serves its metrics."""
    try:
        return relay.published()
    except OSError:
        return 0


def read_topic(bootstrap: str, topic: str, expected: int, timeout: float) -> Counter[str]:
    """How many times each event id is on ``topic`` (its envelope's ``id``), read to the end."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": f"bench-takeover-{os.getpid()}-{time.monotonic_ns()}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
        }
    )
    seen: Counter[str] = Counter()
    ended: set[int] = set()
    consumer.subscribe([topic])
    deadline = time.monotonic() + timeout
    try:
        while (len(ended) < PARTITIONS or sum(seen.values()) < expected) and (
            time.monotonic() < deadline
        ):
            for message in consumer.consume(1000, 1.0):
                error = message.error()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF:
                        ended.add(message.partition() or 0)
                        continue
                    raise RuntimeError(f"{NAME}: reading {topic}: {error}")
                ended.discard(message.partition() or 0)
                seen[str(json.loads(message.value() or b"{}")["id"])] += 1
    finally:
        consumer.close()
    return seen


class TakeoverBench:
    def __init__(self, ctx: BenchContext, kafka: Kafka, table: Table) -> None:
        self.ctx = ctx
        self.kafka = kafka
        self.table = table
        self.events = ctx.events or (QUICK_EVENTS if ctx.quick else EVENTS)
        self.lease = QUICK_LEASE_SECONDS if ctx.quick else LEASE_SECONDS
        placeholders = table.outbox.names.placeholders()
        self.sql = {
            name: sql.format_map(placeholders)
            for name, sql in {
                "claims": CLAIMS,
                "first_records": FIRST_RECORDS,
                "all_ids": ALL_IDS,
            }.items()
        }

    def log(self, message: str) -> None:
        self.ctx.log(f"{NAME}: {message} (load {load_average()})")

    def relay(self) -> RelayProcess:
        return RelayProcess(
            self.table.url,
            self.kafka.bootstrap,
            drain=False,
            extra=("--lease-seconds", f"{self.lease:g}"),
        )

    def claims(self) -> set[tuple[str, str, datetime]]:
        with self.table.engine.begin() as conn:
            return {(r[0], r[1], r[2]) for r in conn.execute(text(self.sql["claims"]))}

    def run_once(self) -> Takeover:
        with self.kafka.topic("bench-takeover") as topic:
            fill = ServerFill(topic, others=self.events, keys=self.events // EVENTS_PER_KEY)
            self.table.fill_server_side(fill)
            a, b = self.relay(), self.relay()
            try:
                while published(a) + published(b) < self.events * KILL_AT:
                    for relay in (a, b):
                        if not relay.alive():
                            exit = relay.wait()
                            raise RuntimeError(
                                f"{NAME}: a relay exited {exit.returncode} before the kill: "
                                f"{exit.stderr[-2000:]}"
                            )
                    time.sleep(0.005)
                os.kill(a.pid, signal.SIGKILL)
                killed, sent_before = time.perf_counter(), b.published()
                a.wait(30)
                before = metrics(b)
                first = self.claims()
                time.sleep(CLAIMS_APART)
                dead = sorted(first & self.claims())
                if not dead:
                    raise RuntimeError(f"{NAME}: relay A held no keys when it was killed")
                # Relay B's rate from the kill to the first lease end: it is at full
                # rate when it takes the keys over.
                with self.table.engine.begin() as conn:
                    now = conn.execute(text("SELECT now()")).scalar_one()
                takeover = time.perf_counter() + (min(r[2] for r in dead) - now).total_seconds()
                time.sleep(max(0.0, takeover - time.perf_counter()))
                rate = (b.published() - sent_before) / (time.perf_counter() - killed)
                busy = bool(self.table.scalar("any_pending"))
                deadline = time.monotonic() + RUN_TIMEOUT
                while self.table.scalar("any_pending"):
                    if not b.alive() or time.monotonic() > deadline:
                        raise RuntimeError(f"{NAME}: events still pending, relay B stopped")
                    time.sleep(0.05)
                after = metrics(b)
            finally:
                for relay in (a, b):
                    with contextlib.suppress(Exception):
                        relay.stop()
            with self.table.engine.begin() as conn:
                waits = [
                    float(r[0])
                    for r in conn.execute(
                        text(self.sql["first_records"]),
                        {"keys": [r[0] for r in dead], "ends": [r[2] for r in dead]},
                    )
                ]
                ids = set(conn.execute(text(self.sql["all_ids"])).scalars())
            self.table.expect_drained(self.events, NAME)
            seen = read_topic(self.kafka.bootstrap, topic, len(ids), timeout=120)
            lost = ids - set(seen)
            twice = [i for i, n in seen.items() if n > 1]
            if lost or twice:
                raise RuntimeError(
                    f"{NAME}: {len(lost):,} events not on the topic, {len(twice):,} on it twice"
                )
            if len(waits) != len(dead):
                raise RuntimeError(
                    f"{NAME}: {len(dead) - len(waits)} of the dead relay's keys were never "
                    "recorded after their lease ended"
                )

        def delta(name: str) -> float:
            return after.get(name, 0.0) - before.get(name, 0.0)

        return Takeover(
            dead_keys=len(dead),
            first_record_median=statistics.median(waits),
            first_record_worst=max(waits),
            read_backs=int(delta("outbox_read_backs_total")),
            messages_read=int(delta("outbox_read_back_messages_total")),
            matched=int(delta("outbox_read_back_matched_total")),
            unproven=int(delta("outbox_read_back_unproven_total")),
            read_back_seconds=delta("outbox_read_back_seconds_sum"),
            rate=rate,
            busy=busy,
        )


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError("the takeover bench needs Kafka (--bootstrap-servers or embedded)")
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    kafka = Kafka(ctx.bootstrap_servers)
    runs: list[Takeover] = []
    with ctx.fresh_database("bench_takeover") as url:
        table = Table(ctx, url, outbox)
        try:
            bench = TakeoverBench(ctx, kafka, table)
            for i in range(ctx.runs):
                bench.log(
                    f"run {i + 1}/{ctx.runs}: {bench.events:,} events, lease {bench.lease:g} s"
                )
                found = bench.run_once()
                bench.log(str(found))
                runs.append(found)
        finally:
            table.close()
    shape = (
        f"2 relay processes, lease {bench.lease:g} s, {bench.events:,} events of 200 B over "
        f"{bench.events // EVENTS_PER_KEY:,} keys on {PARTITIONS} partitions; relay A "
        f"SIGKILLed at {KILL_AT:.0%} published"
    )
    ctx.notes.append(
        f"{NAME}: {shape}; relay B goes on at full rate and takes A's keys over when their "
        "leases end. takeover → first record: per key A held, from its lease end to its "
        "first event recorded again; messages read: relay B's "
        "outbox_read_back_messages_total over the run. Each run reads the topic back: "
        "every event on it once"
    )

    def result(measurement: str, unit: str, values: list[float], note: str = "") -> Result:
        return Result(NAME, measurement, unit, tuple(values), note=note)

    return [
        result(
            "takeover → first record, median over the dead relay's keys",
            "s",
            [r.first_record_median for r in runs],
            f"keys taken over per run: {', '.join(f'{r.dead_keys:,}' for r in runs)}",
        ),
        result("takeover → first record, worst key", "s", [r.first_record_worst for r in runs]),
        result(
            "messages read per takeover",
            "messages",
            [float(r.messages_read) for r in runs],
            "read-backs per run: "
            + ", ".join(str(r.read_backs) for r in runs)
            + "; matched (found on Kafka, not resent): "
            + ", ".join(f"{r.matched:,}" for r in runs)
            + "; unproven: "
            + ", ".join(str(r.unproven) for r in runs),
        ),
        result(
            "read-back seconds per takeover",
            "s",
            [r.read_back_seconds for r in runs],
        ),
        result(
            "relay B from the kill to the takeover",
            "events/s",
            [r.rate for r in runs],
            "its rate until the dead relay's first lease ended: what the read-back "
            "finds on the partitions after the dead relay's floors; events still pending "
            "then (B busy at the takeover): " + ", ".join("yes" if r.busy else "no" for r in runs),
        ),
    ]
