"""Relay throughput against its limits, by message size and number of relay processes.

Every measurement sends ``order.paid`` events with a payload of 200 B, 2 KiB
or 20 KiB of JSON (:mod:`bench.workload`) from an outbox pre-filled
(untimed) by ``enqueue_many`` with ``N`` events over ``N / 5`` keys, to a
fresh topic of :data:`~bench.broker.PARTITIONS` partitions:

* ``raw producer``: a ``confluent_kafka.Producer`` with the relay's own
  configuration sends the pre-encoded messages from memory, one delivery
  callback each, one flush: the physical limit;
* ``naive loop``: SELECT 1,000 pending rows, produce, flush, UPDATE them
  delivered, repeat; no ordering, no leases;
* ``relay x1, in process``: ``Relay(settings).drain()`` in this process;
* ``relay xK, processes``: K ``outbox-kafka relay`` processes (run mode),
  held at their first claim by a lock on the key queue until all have
  started (:func:`bench.processes.gated_relays`); the clock runs from the
  release until no event is pending. x1 at every size, x2 and x4 at 200 B.

The producers (raw, naive, in-process relay) have delivered one message
before the clock starts. The relay x1 processes also give the resource
figures: CPU seconds per 10,000 events inside the timed window and peak RSS.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any

from outbox_kafka import Event, Outbox
from outbox_kafka.relay import Relay
from outbox_kafka.stored_headers import headers_from_json

from .broker import PARTITIONS, Kafka
from .common import (
    BenchContext,
    PlotPoint,
    Result,
    Target,
    as_in_a_relay_process,
    load_average,
    paired_ratios,
)
from .processes import empty_drain, gated_relays
from .producer import EVENT_TYPE, ROUTES, SCHEMA_DIR
from .tables import CALLS_PER_TRANSACTION, FILL_BATCH, Table
from .workload import DEFAULT_SIZE, SIZES, events_for, size_label, spread

NAME = "throughput"
#: Events per measurement, by payload size; quick runs use the smaller counts.
EVENTS = {200: 30_000, 2_048: 20_000, 20_480: 5_000}
QUICK_EVENTS = {200: 5_000, 2_048: 2_000, 20_480: 1_000}
EVENTS_PER_KEY = 5
#: Relay processes started together (at the default size).
RELAY_PROCESSES = (1, 2, 4)
#: The naive loop's batch, and the relay's (its default).
BATCH = 1_000

#: The relay, which records every delivery and keeps per-key order, is to be no slower
#: than a loop that does neither.
TARGET_VS_NAIVE = Target(1.0)
#: A retired target, shown beside the ratio for reference and not scored: the naive
#: loop itself stays far below it on this machine (see docs/explanation/performance.md).
REFERENCE_VS_RAW = 0.25
#: More relays never lower the total throughput.
TARGET_SCALING = Target(1.0)

Samples = dict[str, list[float]]


class ThroughputBench:
    def __init__(self, ctx: BenchContext, kafka: Kafka, outbox: Outbox) -> None:
        self.ctx = ctx
        self.kafka = kafka
        self.outbox = outbox
        self.counts = {
            size: ctx.events or (QUICK_EVENTS if ctx.quick else EVENTS)[size] for size in SIZES
        }
        self.samples: Samples = {}

    def log(self, message: str) -> None:
        self.ctx.log(f"{NAME}: {message} (load {load_average()})")

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def workload(self, size: int, topic: str) -> Iterator[Event]:
        count = self.counts[size]
        return events_for(count, spread(max(1, count // EVENTS_PER_KEY)), topic, size)

    def warm_relay(self, table: Table) -> Relay:
        """A relay on ``table`` that has relayed one event (to the warm-up topic)."""
        relay = Relay(self.kafka.settings(table.url))
        try:
            table.fill(events_for(1, spread(1), self.kafka.warm_up_topic))
            report = relay.drain()
            if report.delivered != 1:
                raise RuntimeError(f"the relay's warm-up event was not delivered: {report}")
            table.statement("truncate")
        except BaseException:
            relay.close()
            raise
        return relay

    # The measurements, each on a fresh topic --------------------------------

    def raw_producer(self, size: int) -> float:
        with self.kafka.topic() as topic:
            messages = [
                (e.key.encode(), e.value, e.headers)
                for e in map(self.outbox.encode, self.workload(size, topic))
            ]
            producer = self.kafka.producer()
            failures: list[Any] = []

            def on_delivery(err: Any, msg: Any) -> None:
                if err is not None:
                    failures.append(err)

            produce = producer.produce
            start = time.perf_counter()
            for key, value, headers in messages:
                while True:
                    try:
                        produce(topic, value, key, headers=headers, on_delivery=on_delivery)
                        break
                    except BufferError:
                        producer.poll(0.05)
            remaining = producer.flush(60)
            seconds = time.perf_counter() - start
        if remaining or failures:
            raise RuntimeError(f"raw producer: {remaining} undelivered, errors {failures[:3]}")
        return len(messages) / seconds

    def naive_loop(self, table: Table, size: int) -> float:
        with self.kafka.topic() as topic:
            count, _ = table.fill(self.workload(size, topic))
            producer = self.kafka.producer()
            failures: list[Any] = []

            def on_delivery(err: Any, msg: Any) -> None:
                if err is not None:
                    failures.append(err)

            raw = table.engine.raw_connection()
            try:
                dbapi: Any = raw.driver_connection
                cur = dbapi.cursor()
                select, mark = table.sql["naive_select"], table.sql["naive_mark"]
                produce = producer.produce
                start = time.perf_counter()
                while True:
                    cur.execute(select, {"limit": BATCH})
                    rows = cur.fetchall()
                    if not rows:
                        dbapi.commit()
                        break
                    ids = []
                    for event_id, key, topic_name, value, headers in rows:
                        produce(
                            topic_name,
                            bytes(value),
                            key.encode(),
                            headers=headers_from_json(headers),
                            on_delivery=on_delivery,
                        )
                        ids.append(event_id)
                    if producer.flush(30) or failures:
                        raise RuntimeError(f"naive loop: delivery failed: {failures[:3]}")
                    cur.execute(mark, {"ids": "{" + ",".join(ids) + "}"})
                    dbapi.commit()
                seconds = time.perf_counter() - start
                cur.close()
            finally:
                raw.close()
        table.expect_drained(count, "naive loop")
        return count / seconds

    def relay_in_process(self, table: Table, size: int) -> float:
        relay = self.warm_relay(table)
        registry = relay.metrics.registry
        phases = ("claim", "publish", "mark")

        def phase_seconds(phase: str) -> float:
            return registry.get_sample_value(f"outbox_{phase}_duration_seconds_sum") or 0.0

        try:
            with self.kafka.topic() as topic:
                count, _ = table.fill(self.workload(size, topic))
                before = {phase: phase_seconds(phase) for phase in phases}
                start = time.perf_counter()
                report = relay.drain()
                seconds = time.perf_counter() - start
        finally:
            relay.close()
        if report.delivered != count:
            raise RuntimeError(f"relay x1: delivered {report.delivered:,} of {count:,}")
        table.expect_drained(count, "relay x1")
        if size == DEFAULT_SIZE:
            for phase in phases:
                total = phase_seconds(phase) - before[phase]
                self.add(f"phase:{phase}", total / count * 1e6)
        return count / seconds

    def relay_processes(self, table: Table, size: int, processes: int) -> float:
        label = f"x{processes}:{size}"
        with self.kafka.topic() as topic:
            count, _ = table.fill(self.workload(size, topic))
            run = gated_relays(table, self.kafka.bootstrap, processes)
        table.expect_drained(count, f"relay x{processes}")
        self.add(f"cpu10k:{label}", sum(run.cpu_seconds) / count * 1e4)
        for rank, seconds in enumerate(sorted(run.cpu_seconds, reverse=True)):
            self.add(f"cpu:{label}:{rank}", seconds)
        self.add(f"share:{label}", 100 * max(run.published) / max(1, sum(run.published)))
        self.add(f"rss:{label}", max(run.peak_rss_bytes) / 2**20)
        self.log(
            f"x{processes} processes, {size_label(size)}: {run.seconds:.2f} s, sent "
            f"{'/'.join(f'{n:,}' for n in run.published)}, CPU "
            f"{'/'.join(f'{c:.2f}' for c in run.cpu_seconds)} s"
            + (f"; logs: {' | '.join(run.logs[:3])}" if run.logs else "")
        )
        return count / run.seconds

    def startup(self, table: Table) -> float:
        table.statement("truncate")
        startup = empty_drain(table.url, self.kafka.bootstrap)
        self.add("startup:cpu", startup.cpu_seconds)
        self.add("startup:rss", startup.peak_rss_bytes / 2**20)
        return startup.seconds

    # The section ------------------------------------------------------------

    def measure(self) -> None:
        ctx = self.ctx
        with ctx.fresh_database("bench_throughput") as url:
            table = Table(ctx, url, self.outbox)
            try:
                with as_in_a_relay_process():
                    self._measure_runs(table)
            finally:
                table.close()

    def _measure_runs(self, table: Table) -> None:
        """Every run of every measurement, on ``table``."""
        ctx = self.ctx
        for run in range(ctx.runs):
            for size in SIZES:
                self.log(
                    f"run {run + 1}/{ctx.runs}, {size_label(size)}, {self.counts[size]:,} events"
                )
                measure: dict[str, Callable[[], float]] = {
                    f"raw:{size}": partial(self.raw_producer, size),
                    f"naive:{size}": partial(self.naive_loop, table, size),
                    f"relay:{size}": partial(self.relay_in_process, table, size),
                }
                for n in RELAY_PROCESSES if size == DEFAULT_SIZE else (1,):
                    measure[f"x{n}:{size}"] = partial(self.relay_processes, table, size, n)
                for name, fn in measure.items():
                    self.add(name, fn())
            self.add("startup", self.startup(table))

    def results(self) -> list[Result]:
        s = self.samples

        def keys(size: int) -> int:
            return max(1, self.counts[size] // EVENTS_PER_KEY)

        def rate(name: str, size: int, what: str, label: str) -> Result:
            return Result(
                NAME,
                f"{what}, {size_label(size)}",
                "events/s",
                tuple(s[f"{name}:{size}"]),
                keys(size),
                plot=PlotPoint("throughput", size_label(size), label),
            )

        results: list[Result] = []
        for size in SIZES:
            results += [
                rate("raw", size, "raw idempotent producer, from memory", "raw\nproducer"),
                rate(
                    "naive", size, f"naive loop (SELECT {BATCH:,}, produce, UPDATE)", "naive\nloop"
                ),
                rate("relay", size, "relay x1, in process: drain()", "relay x1\nin process"),
            ]
            for n in RELAY_PROCESSES if size == DEFAULT_SIZE else (1,):
                results.append(
                    rate(f"x{n}", size, f"relay x{n}, processes", f"relay x{n}\nprocesses")
                )
        for size in SIZES:
            results += [
                Result(
                    NAME,
                    f"relay x1 in process ÷ naive loop, {size_label(size)}",
                    "x",
                    paired_ratios(s[f"relay:{size}"], s[f"naive:{size}"]),
                    target=TARGET_VS_NAIVE,
                ),
                Result(
                    NAME,
                    f"relay x1 in process ÷ raw producer, {size_label(size)}",
                    "x",
                    paired_ratios(s[f"relay:{size}"], s[f"raw:{size}"]),
                    note=f"reference, not scored: the retired ≥ {REFERENCE_VS_RAW}x target",
                ),
            ]
        default = DEFAULT_SIZE
        pairs = [(2, 1), (4, 2), (4, 1)]
        results += [
            Result(
                NAME,
                f"relay x{more} ÷ relay x{fewer} (processes, total events/s), "
                f"{size_label(default)}",
                "x",
                paired_ratios(s[f"x{more}:{default}"], s[f"x{fewer}:{default}"]),
                target=TARGET_SCALING,
            )
            for more, fewer in pairs
            if more in RELAY_PROCESSES and fewer in RELAY_PROCESSES
        ]
        for n in RELAY_PROCESSES:
            label = f"x{n}:{default}"
            split = " / ".join(f"{statistics.median(s[f'cpu:{label}:{r}']):.2f}" for r in range(n))
            results.append(
                Result(
                    NAME,
                    f"relay x{n} processes: CPU per 10,000 events (all processes), "
                    f"{size_label(default)}",
                    "CPU s",
                    tuple(s[f"cpu10k:{label}"]),
                    keys(default),
                    note=f"CPU s per process, busiest first: {split}",
                )
            )
            if n > 1:
                results.append(
                    Result(
                        NAME,
                        f"relay x{n} processes: share of the events sent by the busiest",
                        "%",
                        tuple(s[f"share:{label}"]),
                        keys(default),
                    )
                )
        results += [
            Result(
                NAME,
                f"relay x1 in process: {label} per event, {size_label(default)}",
                "µs/event",
                tuple(s[f"phase:{phase}"]),
                keys(default),
            )
            for phase, label in (
                ("claim", "claim"),
                ("publish", "publish (produce + delivery reports)"),
                ("mark", "finish statement"),
            )
        ]
        return results

    def resources(self) -> list[Result]:
        """Relay x1 process: CPU per 10,000 events and peak RSS at every size."""
        s = self.samples
        results: list[Result] = []
        for size in SIZES:
            label = f"x1:{size}"
            count = self.counts[size]
            results += [
                Result(
                    "resources",
                    f"relay x1 process, {count:,} events, {size_label(size)}: "
                    "CPU per 10,000 events",
                    "CPU s",
                    tuple(s[f"cpu10k:{label}"]),
                    max(1, count // EVENTS_PER_KEY),
                    note="inside the timed window (start-up and shutdown excluded)",
                ),
                Result(
                    "resources",
                    f"relay x1 process, {count:,} events, {size_label(size)}: peak RSS",
                    "MiB",
                    tuple(s[f"rss:{label}"]),
                    max(1, count // EVENTS_PER_KEY),
                    note="VmHWM of the process at the end of the window",
                ),
            ]
        results += [
            Result(
                "resources",
                "relay x1 process, --drain of an empty outbox: start-up to exit",
                "s",
                tuple(s["startup"]),
                note=f"CPU {statistics.median(s['startup:cpu']):.2f} s, "
                f"peak RSS {statistics.median(s['startup:rss']):.0f} MiB",
            ),
        ]
        return results


def notes(bench: ThroughputBench, outbox: Outbox) -> list[str]:
    sizes = []
    for size in SIZES:
        sample = outbox.encode(next(events_for(1, spread(1), "t", size)))
        sizes.append(
            f"{size_label(size)} of data = {len(sample.value):,}-byte value "
            f"({bench.counts[size]:,} events)"
        )
    return [
        f"throughput: `{EVENT_TYPE}` events (valid against schemas/events/{EVENT_TYPE}.json, "
        f"the padding in `payment_id`) with {len(sample.headers)} headers; payload sizes: "
        + "; ".join(sizes)
        + f"; a fresh topic of {PARTITIONS} partitions per measurement, deleted after it; "
        "relays with RelaySettings defaults (batch 1,000, linger.ms 5, acks=all, idempotence)",
        f"throughput: tables hold N events over N / {EVENTS_PER_KEY} keys, filled untimed by "
        f"enqueue_many ({FILL_BATCH:,} per call, {CALLS_PER_TRANSACTION} calls per transaction) "
        "and ANALYZEd; the raw producer, naive loop and in-process relay have delivered one "
        "warm-up message (to another topic) before the clock starts; the naive loop runs its "
        "SELECT and UPDATE on a raw psycopg2 cursor, as the relay does; before any of them is "
        "timed, the bench freezes its objects out of the garbage collector's sight (gc.freeze), "
        "as `outbox-kafka relay` does once started, so that full collections walk neither "
        "side's process heap",
        "throughput: `relay xK, processes` = K `python -m outbox_kafka.cli relay` processes "
        "(run mode, defaults) started together while the bench holds an ACCESS EXCLUSIVE "
        "lock on the key queue; once all K claims wait on it (pg_stat_activity) and 0.5 s "
        "more (their producers connect and get producer ids), the lock is released; the "
        "clock stops when the bench (polling every 10 ms) first finds no pending event, and "
        "the relays are then stopped with SIGTERM; each process's share is its "
        "outbox_events_published_total from its /metrics; x1 of this kind is run at every "
        "size, x2 and x4 at 200 B",
        "throughput: CPU = user + system time of each relay process (all threads) from "
        "/proc/<pid>/stat at the release and at the end of the window; per 10,000 events "
        "= the processes' sum over the events; the CPU of PostgreSQL, the broker and the "
        "bench is not in it",
        "resources: peak RSS = VmHWM of the relay x1 process (/proc/<pid>/status) at the "
        "end of its window; the empty-outbox row is one `relay --drain` with nothing to do, "
        "start to exit (CPU and VmHWM sampled every 10 ms)",
    ]


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError("the throughput bench needs Kafka (--bootstrap-servers or embedded)")
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    kafka = Kafka(ctx.bootstrap_servers)
    bench = ThroughputBench(ctx, kafka, outbox)
    bench.measure()
    ctx.notes += notes(bench, outbox)
    return bench.results() + bench.resources()
