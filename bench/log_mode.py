"""The log mode against the polling tables: what writers pay, and commit-to-consumer latency.

Both parts run on a server with ``wal_level = logical``: the one under test if
it has it, else an embedded server started for this section with it (and the
same build as the default embedded server). One migrated database holds the
outbox's tables, the publication and the slot (as ``log-setup`` makes them).

* **Writers.** The business transaction of :mod:`bench.business` (one
  ``orders`` row plus one event, committed) with a plain INSERT of the event's
  bytes, with ``enqueue`` into the outbox's tables, and with ``enqueue`` of an
  outbox that writes to the log, interleaved round by round; 8 and 16 writers
  over 1,000 keys and on one hot key. No relay runs meanwhile (as in the
  business section); the slot is moved past what they wrote afterwards. The
  targets: the log mode's transactions/s at least 0.85 times the plain
  INSERT's over 1,000 keys, 0.80 times on one hot key. Beside them, the CPU
  each transaction cost the writers (this process, whose threads they are)
  and, when the section started the server itself, the server (its processes'
  CPU from ``/proc``).
* **Latency.** At 1,000 events/s, as in :mod:`bench.latency` (the same writer
  processes and schedule over 1,000 keys), once with ``outbox-kafka relay``
  and the tables, once with ``outbox-kafka relay --source log`` and the log,
  alternating run by run. Latency is measured the same way for both, outside
  the relay: from the moment the writer's commit returned to the moment a
  consumer of the topic (polling every few milliseconds, from offset 0) got the
  message. That is commit-to-ack plus the consumer's fetch, which both modes
  share. The target: the log mode's p99 no worse than the tables'. The same
  for commit-to-produced: the message's CreateTime, which the relay's
  producer sets when it takes the event (commit-to-ack without the wait for
  the acknowledgement).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import multiprocessing
import multiprocessing.pool
import os
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka import Consumer, TopicPartition

from outbox_kafka import Outbox, migrate
from outbox_kafka.database import normalise_url
from outbox_kafka.demo.embedded import free_port, start_postgres_on_port
from outbox_kafka.demo.local_stack import LOG_MODE_SETTINGS
from outbox_kafka.naming import TableNames
from outbox_kafka.operations.log_setup import set_up_log

from .broker import PARTITIONS, Kafka
from .business import SQL as BUSINESS_SQL
from .business import BusinessBench, Item
from .common import BenchContext, Result, Target, load_average, paired_ratios
from .latency import READY_SECONDS, WRITER_PROCESSES, WRITER_THREADS, WriterJob, write_share
from .processes import RelayProcess
from .producer import EVENT_TYPE, ROUTES, SCHEMA_DIR, statement
from .tables import Table
from .workload import events_for, spread

NAME = "log"
KEY_SHAPES = (1_000, 1)
WRITERS = (8, 16)
QUICK_WRITERS = (8,)
TRANSACTIONS = 8_000
QUICK_TRANSACTIONS = 2_000
THROUGHPUT_TARGETS = {1_000: Target(0.85), 1: Target(0.80)}

RATE = 1_000
SECONDS = 5.0
QUICK_SECONDS = 2.0
KEYS = 1_000
#: From handing out the jobs to the first event's due time: writers start, connect.
START_DELAY = 1.5
CATCH_UP_SECONDS = 60.0
#: The consumer's longest wait in a fetch, ms: short, so that it adds little to either mode.
FETCH_WAIT_MS = 5


SQL = {
    "wal_level": "SHOW wal_level",
    "advance_slot": "SELECT pg_replication_slot_advance(%(slot)s, pg_current_wal_lsn())",
    "drop_slot": """
        SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots
        WHERE slot_name = %(slot)s AND NOT active
    """,
}

MODES = {"tables": "table", "log": "log"}

_TICKS = os.sysconf("SC_CLK_TCK")


class ServerCpu:
    """CPU seconds (user + system) used so far by a server on this machine: its
    postmaster and every process it started (backends, WAL writer, checkpointer, ...)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir

    def seconds(self) -> float:
        postmaster = int((self.data_dir / "postmaster.pid").read_text().split()[0])
        total = 0.0
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                with open(f"/proc/{entry.name}/stat", encoding="ascii") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue  # gone meanwhile
            if int(entry.name) == postmaster or int(fields[1]) == postmaster:
                total += (int(fields[11]) + int(fields[12])) / _TICKS
        return total


@dataclass(frozen=True)
class LogicalServer:
    """A database URL on a server with ``wal_level = logical``; its CPU when it is ours."""

    url: str
    label: str
    cpu: ServerCpu | None


@contextlib.contextmanager
def logical_server(ctx: BenchContext) -> Iterator[LogicalServer]:
    """The server under test if it decodes its log, else an embedded one started with
    ``wal_level = logical`` for this section."""
    admin = ctx.admin_engine()
    try:
        with admin.connect() as conn:
            level = conn.exec_driver_sql(SQL["wal_level"]).scalar_one()
    finally:
        admin.dispose()
    if level == "logical":
        yield LogicalServer(ctx.server_url, ctx.database_label, None)
        return
    with tempfile.TemporaryDirectory(prefix="outbox-kafka-bench-log-") as base:
        ctx.log(f"{NAME}: the server's wal_level is {level}; starting an embedded one with logical")
        data_dir = Path(base) / "pgdata"
        pg = start_postgres_on_port(data_dir, free_port(), LOG_MODE_SETTINGS)
        try:
            yield LogicalServer(
                normalise_url(pg.url),
                f"embedded PostgreSQL started for this section with wal_level = logical "
                f"(the server under test has {level})",
                ServerCpu(data_dir),
            )
        finally:
            pg.stop()


@contextlib.contextmanager
def log_database(ctx: BenchContext, names: TableNames) -> Iterator[str]:
    """A fresh migrated database with the outbox's publication and slot; the slot is
    dropped before the database is."""
    with ctx.fresh_database("bench_log") as url:
        engine = ctx.engine_factory(url, pool_size=1)
        try:
            migrate(engine)
            set_up_log(engine, names)
        finally:
            engine.dispose()
        try:
            yield url
        finally:
            admin = ctx.admin_engine()
            try:
                with admin.connect() as conn:
                    conn.exec_driver_sql(SQL["drop_slot"], {"slot": names.log_slot})
            finally:
                admin.dispose()


def advance_slot(engine: sa.Engine, names: TableNames) -> None:
    """Move the slot past everything written so far (no relay is to read it)."""
    with engine.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        auto.exec_driver_sql(SQL["advance_slot"], {"slot": names.log_slot})


# -- writers ---------------------------------------------------------------------------------


def measure_writers(
    ctx: BenchContext, url: str, names: TableNames, server_cpu: ServerCpu | None
) -> list[Result]:
    tables = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    log = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES, write_to="log")
    writer_counts = QUICK_WRITERS if ctx.quick else WRITERS
    count = ctx.events or (QUICK_TRANSACTIONS if ctx.quick else TRANSACTIONS)
    results: list[Result] = []
    engine = ctx.engine_factory(url, pool_size=max(writer_counts) + 1)
    try:
        with engine.begin() as conn:
            conn.execute(statement("create_plain_events", tables))
            conn.execute(sa.text(BUSINESS_SQL["create_orders"]))
        bench = BusinessBench(ctx, engine, url, tables)

        def enqueue_log(plan: list[list[Item]]) -> float:
            def do(conn: sa.Connection, item: Item) -> None:
                e = item[1]
                log.enqueue(conn, type=e.type, key=e.key, data=e.data)

            return bench.per_transaction(plan, do)

        measurements: dict[str, Callable[[list[list[Item]]], float]] = {
            "plain INSERT": bench.plain,
            "enqueue (tables)": bench.enqueue,
            "enqueue (log)": enqueue_log,
        }
        #: By measurement: CPU seconds per transaction of each call, by side.
        used: dict[str, dict[str, list[float]]] = {
            name: {"writers": [], "server": []} for name in measurements
        }
        measurements = {
            name: with_cpu(measure, server_cpu, used[name])
            for name, measure in measurements.items()
        }
        for writers in writer_counts:
            for keys in KEY_SHAPES:
                n = max(writers, count - count % writers)
                ctx.log(f"{NAME}: {keys:,} key(s), {writers} writers, {n:,} transactions")
                for sides in used.values():
                    for values in sides.values():
                        values.clear()
                samples = bench.measure(keys, writers, n, measurements)
                results += writer_results(samples, keys, writers)
                results += cpu_results(used, keys, writers)
        advance_slot(engine, names)
    finally:
        engine.dispose()
    return results


def writer_results(samples: dict[str, list[float]], keys: int, writers: int) -> Iterator[Result]:
    for name, values in samples.items():
        yield Result(
            NAME, f"{name}: transactions/s", "tx/s", tuple(1 / v for v in values), keys, writers
        )
    plain = samples["plain INSERT"]
    for name in ("enqueue (tables)", "enqueue (log)"):
        yield Result(
            NAME,
            f"{name} ÷ plain INSERT: transactions/s",
            "x",
            paired_ratios(plain, samples[name]),
            keys,
            writers,
            target=THROUGHPUT_TARGETS[keys] if name == "enqueue (log)" else None,
        )


def with_cpu(
    measure: Callable[[list[list[Item]]], float],
    server: ServerCpu | None,
    into: dict[str, list[float]],
) -> Callable[[list[list[Item]]], float]:
    """``measure``, appending to ``into`` the CPU seconds per transaction of each call:
    the writers' (this process: its threads are the writers) and, when it runs here,
    the server's."""

    def measured(plan: list[list[Item]]) -> float:
        server_before = 0.0 if server is None else server.seconds()
        writers_before = time.process_time()
        per_transaction = measure(plan)
        count = sum(len(items) for items in plan)
        into["writers"].append((time.process_time() - writers_before) / count)
        if server is not None:
            into["server"].append((server.seconds() - server_before) / count)
        return per_transaction

    return measured


def cpu_results(
    used: dict[str, dict[str, list[float]]], keys: int, writers: int
) -> Iterator[Result]:
    """The CPU figures of one shape; the first call of each measurement is its untimed
    warm-up."""
    for side, label in (("writers", "writers' CPU"), ("server", "server CPU")):
        timed = {name: sides[side][1:] for name, sides in used.items()}
        if not timed["plain INSERT"]:
            continue  # the server is not on this machine
        for name, values in timed.items():
            yield Result(
                NAME,
                f"{name}: {label} per transaction",
                "µs",
                tuple(v * 1e6 for v in values),
                keys,
                writers,
            )
        yield Result(
            NAME,
            f"enqueue (log) ÷ plain INSERT: {label} per transaction",
            "x",
            paired_ratios(timed["enqueue (log)"], timed["plain INSERT"]),
            keys,
            writers,
        )


# -- latency ---------------------------------------------------------------------------------


class Arrivals:
    """A consumer of every partition of ``topic`` from offset 0, in a thread: when each
    event (by its CloudEvents id) arrived, on ``time.time()``."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        self.seen: dict[str, float] = {}
        #: Each event's message timestamp (CreateTime: when the relay produced it), s.
        self.produced: dict[str, float] = {}
        self._stop = threading.Event()
        self._errors: list[BaseException] = []
        self._consumer = Consumer(
            {
                "bootstrap.servers": bootstrap,
                "group.id": f"bench-log-{uuid.uuid4().hex[:8]}",
                "enable.auto.commit": False,
                "fetch.wait.max.ms": FETCH_WAIT_MS,
                "fetch.min.bytes": 1,
            }
        )
        self._consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        self._thread = threading.Thread(target=self._run, name="arrivals", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                messages = self._consumer.consume(1_000, 0.05)
                now = time.time()
                for m in messages:
                    value = m.value()
                    if m.error() is None and value is not None:
                        event_id = json.loads(value)["id"]
                        self.seen.setdefault(event_id, now)
                        self.produced.setdefault(event_id, m.timestamp()[1] / 1e3)
        except BaseException as exc:
            self._errors.append(exc)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self._consumer.close()
        if self._errors:
            raise self._errors[0]


@dataclass(frozen=True)
class Point:
    """One run of one mode."""

    achieved: float
    p50: float
    p90: float
    p99: float
    max: float
    produced_p50: float
    produced_p99: float
    cpu_per_10k: float


def published(relay: RelayProcess) -> int:
    """What the relay's ``/metrics`` says it published; 0 until it serves them."""
    try:
        return relay.published()
    except OSError:  # not listening yet (URLError is an OSError)
        return 0


def percentile(ordered: list[float], fraction: float) -> float:
    """The nearest-rank percentile of an ascending list."""
    return ordered[min(len(ordered) - 1, max(0, round(fraction * len(ordered)) - 1))]


class LatencyBench:
    def __init__(self, ctx: BenchContext, kafka: Kafka, url: str) -> None:
        self.ctx = ctx
        self.kafka = kafka
        self.url = url
        self.seconds = QUICK_SECONDS if ctx.quick else SECONDS
        self.outboxes = {
            mode: Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES, write_to=write_to)
            for mode, write_to in MODES.items()
        }

    def log(self, message: str) -> None:
        self.ctx.log(f"{NAME}: {message} (load {load_average()})")

    def point(self, table: Table, pool: multiprocessing.pool.Pool, mode: str) -> Point:
        count = max(WRITER_PROCESSES * WRITER_THREADS, int(RATE * self.seconds))
        table.statement("truncate")
        extra = ("--source", "log") if mode == "log" else ()
        with self.kafka.topic("bench-log-latency") as topic:
            arrivals = Arrivals(self.kafka.bootstrap, topic)
            relay = RelayProcess(self.url, self.kafka.bootstrap, drain=False, extra=extra)
            try:
                with table.engine.begin() as conn:
                    self.outboxes[mode].enqueue(
                        conn,
                        type=EVENT_TYPE,
                        key="warm-up",
                        data=next(events_for(1, spread(1), topic)).data,
                        topic=self.kafka.warm_up_topic,
                    )
                relay.wait_for(lambda: published(relay) >= 1, "relaying the warm-up", READY_SECONDS)
                cpu = relay.cpu_seconds()
                start_at = time.monotonic() + START_DELAY
                jobs = [
                    WriterJob(
                        self.url,
                        topic,
                        RATE,
                        count,
                        p,
                        WRITER_PROCESSES,
                        WRITER_THREADS,
                        start_at,
                        write_to=MODES[mode],
                    )
                    for p in range(WRITER_PROCESSES)
                ]
                shares = pool.map(write_share, jobs)
                relay.wait_for(lambda: len(arrivals.seen) >= count, "catching up", CATCH_UP_SECONDS)
                cpu = relay.cpu_seconds() - cpu
            finally:
                try:
                    relay.checked(relay.stop())
                finally:
                    arrivals.close()
        committed = {k: v for share in shares for k, v in share.committed.items()}
        if len(committed) != count or set(arrivals.seen) != set(committed):
            raise RuntimeError(
                f"{NAME}: {len(committed):,} committed, {len(arrivals.seen):,} of {count:,} "
                "on the topic, or not the same ids"
            )
        latencies = sorted(arrivals.seen[k] - t for k, t in committed.items())
        to_produce = sorted(arrivals.produced[k] - t for k, t in committed.items())
        elapsed = max(share.end for share in shares) - start_at
        return Point(
            achieved=count / elapsed,
            p50=percentile(latencies, 0.50) * 1e3,
            p90=percentile(latencies, 0.90) * 1e3,
            p99=percentile(latencies, 0.99) * 1e3,
            max=latencies[-1] * 1e3,
            produced_p50=percentile(to_produce, 0.50) * 1e3,
            produced_p99=percentile(to_produce, 0.99) * 1e3,
            cpu_per_10k=cpu / count * 1e4,
        )

    def measure(self) -> dict[str, list[Point]]:
        points: dict[str, list[Point]] = {mode: [] for mode in MODES}
        table = Table(self.ctx, self.url, self.outboxes["tables"], connections=2)
        try:
            with multiprocessing.get_context("spawn").Pool(WRITER_PROCESSES) as pool:
                for run in range(self.ctx.runs):
                    for mode in MODES:
                        self.log(f"run {run + 1}/{self.ctx.runs}, {RATE:,}/s, {mode}")
                        points[mode].append(self.point(table, pool, mode))
        finally:
            table.close()
        return points


def latency_results(points: dict[str, list[Point]]) -> Iterator[Result]:
    for mode, runs in points.items():

        def values(field: str, runs: list[Point] = runs) -> tuple[float, ...]:
            return tuple(getattr(p, field) for p in runs)

        head = f"{RATE:,}/s asked, {mode}"
        yield Result(NAME, f"{head}: writer rate achieved", "events/s", values("achieved"), KEYS)
        for field in ("p50", "p90", "p99", "max"):
            yield Result(NAME, f"{head}: commit→consumed {field}", "ms", values(field), KEYS)
        for field, label in (("produced_p50", "p50"), ("produced_p99", "p99")):
            yield Result(NAME, f"{head}: commit→produced {label}", "ms", values(field), KEYS)
        yield Result(
            NAME,
            f"{head}: relay CPU per 10,000 events",
            "CPU s",
            values("cpu_per_10k"),
            KEYS,
        )
    for field, label in (("p99", "commit→consumed"), ("produced_p99", "commit→produced")):
        yield Result(
            NAME,
            f"{RATE:,}/s asked: {label} p99, log ÷ tables",
            "x",
            paired_ratios(values_of(points["log"], field), values_of(points["tables"], field)),
            KEYS,
            target=Target(1.0, at_most=True),
        )


def values_of(points: list[Point], field: str) -> list[float]:
    return [getattr(p, field) for p in points]


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError("the log bench needs Kafka (--bootstrap-servers or embedded)")
    names = TableNames()
    seconds = QUICK_SECONDS if ctx.quick else SECONDS
    results: list[Result] = []
    with logical_server(ctx) as server:
        label = server.label
        here = dataclasses.replace(ctx, server_url=server.url, database_label=label)
        with log_database(here, names) as url:
            results += measure_writers(here, url, names, server.cpu)
            bench = LatencyBench(here, Kafka(ctx.bootstrap_servers), url)
            results += latency_results(bench.measure())
    ctx.notes += [
        f"{NAME}: on {label}; one database with the outbox's tables, publication and slot",
        f"{NAME}: writers as in the business section (one `orders` row plus one event per "
        "transaction, threads with a connection each): a plain INSERT of the event's bytes, "
        "`enqueue` into the tables, `enqueue` of `Outbox(write_to='log')`, interleaved; no "
        "relay reads meanwhile",
        f"{NAME}: latency at {RATE:,}/s for {seconds:g} s as in the latency section, one relay "
        "process per run (`relay`, or `relay --source log`), tables and log alternating; "
        "commit→consumed = when a consumer of the topic (from offset 0, fetch.wait.max.ms = "
        f"{FETCH_WAIT_MS}) got the event minus when the writer's commit returned, on one "
        "host's clock: commit-to-ack plus a fetch both modes pay (the test broker answers "
        "a waiting fetch in about 25 ms); commit→produced = the message's CreateTime, set "
        "by the relay's producer when it took the event, minus the same commit time "
        "(millisecond timestamps): commit-to-ack without the acknowledgement's wait",
    ]
    return results
