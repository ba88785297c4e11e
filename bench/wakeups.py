"""Wake-ups under load: the server's notification queue while a relay drains a backlog.

For each run: :data:`BACKLOG` events over 1,000 keys are written server-side,
one ``outbox-kafka relay`` process starts, and :data:`WRITERS` writer threads
commit one ``Outbox.enqueue`` per transaction as fast as they can while the
relay drains. Every :data:`SAMPLE_SECONDS` the bench reads
``pg_notification_queue_usage()`` (the share of the cluster-wide queue that
notifications not yet read by every listener hold) and converts it to 8 kB
pages; a session that listens on the outbox's channel, without the wake lock,
counts the notifications the writers sent. Once the backlog is delivered the
writers stop and the relay is stopped.

Target: the queue holds at most one page at every sample.
"""

from __future__ import annotations

import select
import threading
import time
from dataclasses import dataclass

import psycopg2
import psycopg2.extensions
from sqlalchemy.engine import make_url

from outbox_kafka import Outbox
from outbox_kafka.database import make_engine

from .broker import Kafka
from .common import BenchContext, Result, Target
from .processes import RelayProcess
from .producer import ROUTES, SCHEMA_DIR
from .tables import ServerFill, Table
from .workload import events_for, spread

NAME = "wakeups"
BACKLOG = 200_000
QUICK_BACKLOG = 20_000
KEYS = 1_000
WRITERS = 4
SAMPLE_SECONDS = 0.25
DRAIN_TIMEOUT = 600.0
#: pg_notification_queue_usage() is a fraction of this many 8 kB pages (8 GB, the default).
QUEUE_PAGES = 8 * 1024 * 1024 * 1024 // 8192
TARGET_PAGES = Target(1.0, at_most=True)


@dataclass(frozen=True)
class Run:
    peak_pages: float
    samples: int
    drain_seconds: float
    transactions: int
    notifications: int


def _libpq(url: str) -> str:
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


class _Counter(threading.Thread):
    """Listens on the channel (no wake lock) and counts what arrives, until stopped."""

    def __init__(self, url: str, channel: str) -> None:
        super().__init__(daemon=True)
        self.conn = psycopg2.connect(_libpq(url))
        self.conn.autocommit = True
        with self.conn.cursor() as cur:
            cur.execute(f'LISTEN "{channel}"')
        self.count = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            if select.select([self.conn], [], [], 0.1)[0]:
                self.conn.poll()
                self.count += len(self.conn.notifies)
                self.conn.notifies.clear()

    def stop(self) -> int:
        self.stopping.set()
        self.join()
        self.conn.close()
        return self.count


def measure(ctx: BenchContext, kafka: Kafka, table: Table, outbox: Outbox, backlog: int) -> Run:
    with kafka.topic("bench-wakeups") as topic:
        table.fill_server_side(ServerFill(topic, others=backlog, keys=KEYS))
        counter = _Counter(table.url, outbox.names.channel)
        counter.start()
        writing = threading.Event()
        writing.set()
        committed = [0] * WRITERS
        errors: list[BaseException] = []
        engine = make_engine(table.url, pool_size=WRITERS)

        def writer(index: int) -> None:
            events = events_for(10**9, spread(KEYS), topic)
            try:
                with engine.connect() as conn:
                    while writing.is_set():
                        e = next(events)
                        with conn.begin():
                            outbox.enqueue(conn, type=e.type, key=e.key, data=e.data, topic=topic)
                        committed[index] += 1
            except BaseException as exc:
                errors.append(exc)

        relay = RelayProcess(table.url, kafka.bootstrap, drain=False)
        threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(WRITERS)]
        peak = 0.0
        samples = 0
        start = time.monotonic()
        try:
            for thread in threads:
                thread.start()
            while table.scalar("delivered") < backlog:
                if not relay.alive():
                    relay.checked(relay.wait())
                    raise RuntimeError("wakeups: the relay exited during the drain")
                if time.monotonic() - start > DRAIN_TIMEOUT:
                    raise RuntimeError(f"wakeups: not drained after {DRAIN_TIMEOUT:.0f} s")
                with table.engine.connect() as conn:
                    usage = conn.exec_driver_sql(
                        "SELECT pg_notification_queue_usage()"
                    ).scalar_one()
                peak = max(peak, float(usage) * QUEUE_PAGES)
                samples += 1
                time.sleep(SAMPLE_SECONDS)
            drained = time.monotonic() - start
        finally:
            writing.clear()
            for thread in threads:
                thread.join()
            relay.checked(relay.stop())
            engine.dispose()
            notifications = counter.stop()
        if errors:
            raise errors[0]
    return Run(peak, samples, drained, sum(committed), notifications)


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError("the wakeups bench needs Kafka (--bootstrap-servers or embedded)")
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    kafka = Kafka(ctx.bootstrap_servers)
    backlog = QUICK_BACKLOG if ctx.quick else BACKLOG
    runs: list[Run] = []
    with ctx.fresh_database("bench_wakeups") as url:
        table = Table(ctx, url, outbox, connections=2)
        try:
            for n in range(ctx.runs):
                ctx.log(f"{NAME}: run {n + 1}/{ctx.runs}, a {backlog:,}-event drain")
                runs.append(measure(ctx, kafka, table, outbox, backlog))
        finally:
            table.close()
    ctx.notes.append(
        f"{NAME}: {backlog:,} events over {KEYS:,} keys written server-side, then one relay "
        f"process drains them while {WRITERS} writer threads commit one enqueue per "
        f"transaction as fast as they can; pg_notification_queue_usage() every "
        f"{SAMPLE_SECONDS:g} s, in 8 kB pages of the default 8 GB queue; the notifications "
        "counted by a session listening without the wake lock"
    )
    head = f"{backlog:,}-event drain with {WRITERS} writers"
    return [
        Result(
            NAME,
            f"{head}: notification queue, peak",
            "pages",
            tuple(r.peak_pages for r in runs),
            KEYS,
            WRITERS,
            note=f"over {min(r.samples for r in runs)}+ samples per run",
            target=TARGET_PAGES,
        ),
        Result(
            NAME,
            f"{head}: writer transactions committed",
            "tx",
            tuple(float(r.transactions) for r in runs),
            KEYS,
            WRITERS,
        ),
        Result(
            NAME,
            f"{head}: notifications sent",
            "notifies",
            tuple(float(r.notifications) for r in runs),
            KEYS,
            WRITERS,
        ),
        Result(
            NAME, f"{head}: drain time", "s", tuple(r.drain_seconds for r in runs), KEYS, WRITERS
        ),
    ]
