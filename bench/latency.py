"""Commit-to-ack latency at steady write rates, LISTEN on and off; the relay's steady-state cost.

For each rate of :data:`RATES` and each mode, on a truncated table and a
fresh topic:

1. one ``outbox-kafka relay`` process starts (``--no-listen`` for off) and
   relays a warm-up event (to another topic), so it is connected and idle;
2. :data:`WRITER_PROCESSES` writer processes of :data:`WRITER_THREADS`
   threads each (every thread on its own connection) commit one
   ``Outbox.enqueue`` per transaction on one schedule: event ``i`` is due
   :data:`START_DELAY` s after the start plus ``i / rate`` s, over ``1,000``
   keys; a thread that falls behind writes its next events at once, so the
   rate achieved is reported next to the rate asked for;
3. once nothing is pending, the relay is stopped with SIGTERM.

Latency is ``delivered_at - created_at`` of every event on the database
clock (``created_at`` is taken at the insert, just before the commit). The
relay's CPU over the window (from ``/proc`` after the warm-up to the end of
the catch-up) per 10,000 events and its peak RSS (``VmHWM``) are its
resource figures at that rate.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.pool
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

from outbox_kafka import Outbox
from outbox_kafka.database import make_engine

from .broker import Kafka
from .common import BenchContext, PlotPoint, Result, Target, load_average
from .processes import RelayProcess
from .producer import EVENT_TYPE, ROUTES, SCHEMA_DIR
from .tables import Table
from .workload import DEFAULT_SIZE, events_for, spread

NAME = "latency"
RATES = (100, 1_000, 5_000)
#: Seconds of writing per run, by rate (about the same number of runs' worth of events).
SECONDS = {100: 10.0, 1_000: 5.0, 5_000: 3.0}
QUICK_SECONDS = {100: 2.0, 1_000: 2.0, 5_000: 1.0}
KEYS = 1_000
WRITER_PROCESSES = 2
WRITER_THREADS = 4
#: From handing out the jobs to the first event's due time: writers start, connect.
START_DELAY = 1.5
CATCH_UP_SECONDS = 60.0
READY_SECONDS = 60.0

TARGET_P99_MS = Target(25.0, at_most=True)
#: Where the p99 target applies.
TARGET_RATE = 1_000


@dataclass(frozen=True)
class WriterJob:
    """One writer process's share of a run: events ``i`` with ``i % processes == index``."""

    url: str
    topic: str
    rate: float
    count: int
    index: int
    processes: int
    threads: int
    start_at: float  # time.monotonic(), the same clock in every process on one host
    size: int = DEFAULT_SIZE
    keys: int = KEYS
    #: The outbox's ``write_to``: its tables or the write-ahead log.
    write_to: str = "table"


@dataclass(frozen=True)
class Share:
    """What one writer process did: events written, when it ended (``time.monotonic``),
    and each event's commit time (``time.time()`` once the commit returned) by id."""

    written: int
    end: float
    committed: dict[str, float]


def write_share(job: WriterJob) -> Share:
    """Run in a writer process: commit this share on schedule."""
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES, write_to=job.write_to)
    engine = make_engine(job.url, pool_size=job.threads)
    events = [
        (i, e)
        for i, e in enumerate(events_for(job.count, spread(job.keys), job.topic, job.size))
        if i % job.processes == job.index
    ]
    ends = [0.0] * job.threads
    written = [0] * job.threads
    committed: dict[str, float] = {}
    errors: list[BaseException] = []

    def writer(thread: int) -> None:
        try:
            with engine.connect() as conn:
                for i, e in events[thread :: job.threads]:
                    delay = job.start_at + i / job.rate - time.monotonic()
                    if delay > 0:
                        time.sleep(delay)
                    with conn.begin():
                        event_id = outbox.enqueue(
                            conn, type=e.type, key=e.key, data=e.data, topic=e.topic
                        )
                    committed[str(event_id)] = time.time()
                    written[thread] += 1
            ends[thread] = time.monotonic()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(job.threads)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    engine.dispose()
    if errors:
        raise errors[0]
    return Share(sum(written), max(ends), committed)


@dataclass(frozen=True)
class Point:
    """One run at one rate and mode."""

    achieved: float
    p50: float
    p90: float
    p99: float
    max: float
    cpu_per_10k: float
    rss_mib: float


class LatencyBench:
    def __init__(self, ctx: BenchContext, kafka: Kafka, outbox: Outbox) -> None:
        self.ctx = ctx
        self.kafka = kafka
        self.outbox = outbox
        self.seconds = QUICK_SECONDS if ctx.quick else SECONDS

    def log(self, message: str) -> None:
        self.ctx.log(f"{NAME}: {message} (load {load_average()})")

    def point(
        self, table: Table, pool: multiprocessing.pool.Pool, rate: int, listen: bool
    ) -> Point:
        count = max(WRITER_PROCESSES * WRITER_THREADS, int(rate * self.seconds[rate]))
        table.statement("truncate")
        with self.kafka.topic("bench-latency") as topic:
            extra = () if listen else ("--no-listen",)
            relay = RelayProcess(table.url, self.kafka.bootstrap, drain=False, extra=extra)
            try:
                with table.engine.begin() as conn:
                    self.outbox.enqueue(
                        conn,
                        type=EVENT_TYPE,
                        key="warm-up",
                        data=next(events_for(1, spread(1), topic)).data,
                        topic=self.kafka.warm_up_topic,
                    )
                relay.wait_for(
                    lambda: table.scalar("delivered") >= 1,
                    "relaying the warm-up event",
                    READY_SECONDS,
                )
                cpu = relay.cpu_seconds()
                start_at = time.monotonic() + START_DELAY
                jobs = [
                    WriterJob(
                        table.url, topic, rate, count, p, WRITER_PROCESSES, WRITER_THREADS, start_at
                    )
                    for p in range(WRITER_PROCESSES)
                ]
                shares = pool.map(write_share, jobs)
                written = sum(share.written for share in shares)
                elapsed = max(share.end for share in shares) - start_at
                relay.wait_for(
                    lambda: table.scalar("pending") == 0, "catching up", CATCH_UP_SECONDS
                )
                cpu = relay.cpu_seconds() - cpu
                rss = relay.sample_memory()
            finally:
                relay.checked(relay.stop())
            delivered, p50, p90, p99, top = table.latencies(topic)
        if written != count or delivered != count:
            raise RuntimeError(
                f"latency: {written:,} written, {delivered:,} of {count:,} delivered"
            )
        return Point(
            achieved=count / elapsed,
            p50=p50 * 1e3,
            p90=p90 * 1e3,
            p99=p99 * 1e3,
            max=top * 1e3,
            cpu_per_10k=cpu / count * 1e4,
            rss_mib=rss / 2**20,
        )

    def measure(self) -> dict[tuple[int, str], list[Point]]:
        ctx = self.ctx
        points: dict[tuple[int, str], list[Point]] = {}
        modes = {"on": True, "off": False}
        with (
            ctx.fresh_database("bench_latency") as url,
            multiprocessing.get_context("spawn").Pool(WRITER_PROCESSES) as pool,
        ):
            table = Table(ctx, url, self.outbox, connections=2)
            try:
                for run in range(ctx.runs):
                    for rate in RATES:
                        for mode, listen in modes.items():
                            self.log(f"run {run + 1}/{ctx.runs}, {rate:,}/s, LISTEN {mode}")
                            point = self.point(table, pool, rate, listen)
                            points.setdefault((rate, mode), []).append(point)
            finally:
                table.close()
        return points


def results_of(points: dict[tuple[int, str], list[Point]]) -> Iterator[Result]:
    for (rate, mode), runs in points.items():

        def values(field: str, runs: list[Point] = runs) -> tuple[float, ...]:
            return tuple(getattr(p, field) for p in runs)

        head = f"{rate:,}/s asked, LISTEN {mode}"
        yield Result(
            NAME,
            f"{head}: writer rate achieved",
            "events/s",
            values("achieved"),
            KEYS,
            plot=PlotPoint("achieved", f"LISTEN {mode}", float(rate)),
        )
        for field, label in (("p50", "p50"), ("p90", "p90"), ("p99", "p99"), ("max", "max")):
            target = (
                TARGET_P99_MS if field == "p99" and mode == "on" and rate == TARGET_RATE else None
            )
            yield Result(
                NAME,
                f"{head}: commit→ack {label}",
                "ms",
                values(field),
                KEYS,
                target=target,
                plot=PlotPoint("latency", f"LISTEN {mode}|{label}", float(rate)),
            )
    for (rate, mode), runs in points.items():
        head = f"relay process at {rate:,}/s asked, LISTEN {mode}"
        yield Result(
            "resources",
            f"{head}: CPU per 10,000 events",
            "CPU s",
            tuple(p.cpu_per_10k for p in runs),
            KEYS,
            note="over the writing and catch-up window (idle waits included)",
        )
        yield Result(
            "resources",
            f"{head}: peak RSS",
            "MiB",
            tuple(p.rss_mib for p in runs),
            KEYS,
        )


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError("the latency bench needs Kafka (--bootstrap-servers or embedded)")
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    bench = LatencyBench(ctx, Kafka(ctx.bootstrap_servers), outbox)
    points = bench.measure()
    seconds = ", ".join(f"{rate:,}/s for {bench.seconds[rate]:g} s" for rate in RATES)
    ctx.notes += [
        f"latency: steady rates {seconds}, LISTEN on and off (off: the relay polls every "
        "0.5 s, the default); one `outbox-kafka relay` process per run, started and warmed "
        f"up (one event to another topic) before the writers; {WRITER_PROCESSES} writer "
        f"processes x {WRITER_THREADS} threads, one connection each, one Outbox.enqueue per "
        f"transaction over {KEYS:,} keys on one time.monotonic schedule; the writers, the "
        "relay, PostgreSQL and the broker share the machine's CPUs",
        "latency: commit→ack = delivered_at - created_at of every event of the run, on the "
        "database clock (percentile_cont); the writer rate achieved = events over the time "
        "from the first due time to the last commit",
        "resources: the relay process's CPU (/proc/<pid>/stat, all threads) from after its "
        "warm-up to the end of the catch-up, per 10,000 events; peak RSS = its VmHWM then",
    ]
    return list(results_of(points))
