"""Relay throughput against its limits, claim cost under a hot key, commit-to-ack latency.

Everything runs against one broker and one database server, with the same
messages: ``order.paid`` events of about :data:`PAYLOAD_BYTES` bytes of data,
encoded by :meth:`Outbox.encode` into a ~500-byte CloudEvents value with 5
headers. Every measurement gets a fresh topic of :data:`PARTITIONS`
partitions; every section a fresh migrated database, truncated and refilled
(untimed) before each measurement.

1. *Throughput* from a pre-filled outbox of ``N`` events over ``N / 5`` keys
   (so that several relays find keys to share; one relay claims up to 1,000
   keys a cycle):

   * ``raw producer``: a ``confluent_kafka.Producer`` with the relay's own
     configuration sends the pre-encoded messages from memory, one delivery
     callback each, one flush: the physical limit;
   * ``naive loop``: SELECT 1,000 pending rows, produce, flush, UPDATE them
     delivered, repeat; no ordering, no leases (:data:`SQL`);
   * ``relay x1``: ``Relay(settings).drain()`` in this process;
   * ``relay xK``: K processes of ``python -m outbox_kafka.cli relay --drain``
     started at once; total events/s is ``N`` over the wall time until the
     last one exits, so it includes their start-up, measured on its own as
     ``relay x1 subprocess, empty outbox``.

   The producers (raw, naive, in-process relay) are connected to the broker
   before the clock starts.
2. *Hot key*: the claim on a backlog of :data:`HOT_BACKLOG` events on one key
   ahead of 1,000 events on 1,000 other keys, against the same number of
   events spread over 1,000 keys; then relay drain throughput with all
   :data:`HOT_DRAIN_EVENTS` events on one key against 1,000 keys.
3. *Latency*: :data:`LATENCY_WRITERS` writer threads commit one event per
   transaction, together :data:`LATENCY_RATE` events/s on one schedule, while
   ``Relay.run()`` runs in another thread;
   commit-to-ack is ``delivered_at - created_at`` of every event, on the
   database clock, with LISTEN on and off.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from sqlalchemy import Engine, text

from outbox_kafka import Event, Outbox, migrate
from outbox_kafka.envelope import headers_from_json
from outbox_kafka.relay import Relay
from outbox_kafka.settings import RelaySettings
from outbox_kafka.store import Store

from .common import BenchContext, Result, load_average, paired_ratios
from .producer import EVENT_TYPE, PAYLOAD_BYTES, ROUTES, SCHEMA_DIR, payload

NAME = "relay"
PARTITIONS = 6
#: Events per throughput measurement, and how many events each key gets.
EVENTS = 30_000
QUICK_EVENTS = 10_000
EVENTS_PER_KEY = 5
#: Relay processes started together for the multi-relay measurements.
RELAY_PROCESSES = (1, 2, 4)
#: The naive loop's batch, and the relay's (its default).
BATCH = 1_000
#: Fills write ``enqueue_many`` calls of BATCH events, this many per transaction.
CALLS_PER_TRANSACTION = 10
#: The hot key's backlog for the claim measurement, and the keys behind it.
HOT_BACKLOG = 500_000
QUICK_HOT_BACKLOG = 50_000
OTHER_KEYS = 1_000
#: Claims per run of the claim measurement (the run's figure is their median).
CLAIM_CALLS = 9
QUICK_CLAIM_CALLS = 5
HOT_DRAIN_EVENTS = 20_000
QUICK_HOT_DRAIN_EVENTS = 5_000
LATENCY_RATE = 1_000
LATENCY_SECONDS = 10.0
QUICK_LATENCY_SECONDS = 3.0
LATENCY_KEYS = 1_000
#: Writer threads sharing the rate: one thread manages ~900 single-event
#: transactions/s on its own and fewer beside a relay thread, so the rate needs several.
LATENCY_WRITERS = 8
#: How long to wait for a relay to catch up after the writer stops.
CATCH_UP_SECONDS = 60.0

TARGET_VS_NAIVE = 0.5
TARGET_VS_RAW = 0.25
TARGET_SCALING = 1.0
TARGET_HOT_CLAIM = 2.0
TARGET_HOT_THROUGHPUT = 0.5
TARGET_P99_MS = 100.0

#: Every statement this bench runs itself (the outbox's own are in outbox_kafka/sql).
#: ``{events}``, ``{keys}`` and ``{seqs}`` are the outbox's quoted table names. The
#: naive loop's statements are in psycopg2's ``%(name)s`` style: it runs them on a
#: raw driver cursor, as the relay runs its own, so neither pays for SQLAlchemy rows.
SQL: dict[str, str] = {
    "truncate": "TRUNCATE {events}, {keys}, {seqs}",
    "analyze": "ANALYZE {events}, {keys}, {seqs}",
    "pending": "SELECT count(*) FROM {events} WHERE status = 'pending'",
    "delivered": "SELECT count(*) FROM {events} WHERE status = 'delivered'",
    "naive_select": """
        SELECT CAST(event_id AS text), ordering_key, topic, value, headers
        FROM {events}
        WHERE status = 'pending'
        ORDER BY created_at
        LIMIT %(limit)s
    """,
    "naive_mark": """
        UPDATE {events}
        SET status = 'delivered', delivered_at = now()
        WHERE event_id = ANY(CAST(%(ids)s AS uuid[]))
    """,
    # Undo a claim without recording anything: the keys become due again in
    # their original order (the hot key, queued first, stays at the front).
    "release_keys": """
        UPDATE {keys}
        SET claim_token = NULL, lease_expires_at = NULL, due_at = created_at
        WHERE claim_token IS NOT NULL
    """,
    "latency": """
        SELECT count(*),
               percentile_cont(0.5) WITHIN GROUP (ORDER BY s),
               percentile_cont(0.9) WITHIN GROUP (ORDER BY s),
               percentile_cont(0.99) WITHIN GROUP (ORDER BY s),
               max(s)
        FROM (
            SELECT EXTRACT(EPOCH FROM delivered_at - created_at) AS s
            FROM {events}
            WHERE status = 'delivered'
        ) AS d
    """,
}

Samples = dict[str, list[float]]


def events_for(
    count: int, key_of: Callable[[int], str], topic: str, seed: int = 42
) -> Iterator[Event]:
    """``count`` ``order.paid`` events for ``topic``; event ``i`` has key ``key_of(i)``."""
    rng = random.Random(seed)
    for i in range(count):
        yield Event(type=EVENT_TYPE, key=key_of(i), data=payload(rng, i), topic=topic)


def spread(keys: int) -> Callable[[int], str]:
    """Event ``i`` on key ``customer-<i mod keys>``."""
    return lambda i: f"customer-{i % keys:05d}"


def chunks(items: Iterable[Event], size: int) -> Iterator[list[Event]]:
    batch: list[Event] = []
    for item in items:
        batch.append(item)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


class Kafka:
    """The broker: fresh topics, and producers connected before the clock starts."""

    def __init__(self, bootstrap: str) -> None:
        self.bootstrap = bootstrap
        # Kept for the life of the bench: its futures resolve only while it exists.
        self.admin = AdminClient({"bootstrap.servers": bootstrap})
        #: Where warm-up messages go, so the measured topics hold only measured ones.
        self.warm_up_topic = self.new_topic("bench-warm-up", partitions=1)

    def new_topic(self, prefix: str = "bench-relay", partitions: int = PARTITIONS) -> str:
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        futures = self.admin.create_topics([NewTopic(name, partitions, 1)], request_timeout=30)
        for future in futures.values():
            future.result(timeout=60)
        return name

    def settings(self, database_url: str, **overrides: Any) -> RelaySettings:
        return RelaySettings(
            database_url=database_url, bootstrap_servers=self.bootstrap, **overrides
        )

    def producer(self) -> Any:
        """A producer with the relay's configuration that has delivered one message.

        A new idempotent producer's first delivery takes ~0.5 s longer on the
        embedded broker (connection, producer id); none of that is timed.
        """
        producer = Producer(self.settings("postgresql://unused/unused").producer_config())
        producer.produce(self.warm_up_topic, b"warm-up", b"warm-up")
        if producer.flush(30) != 0:
            raise RuntimeError("the warm-up message was not delivered")
        return producer


class Table:
    """One migrated database: fill, truncate, count, read latencies."""

    def __init__(self, ctx: BenchContext, url: str, outbox: Outbox, connections: int = 2) -> None:
        self.url = url
        self.outbox = outbox
        self.engine: Engine = ctx.engine_factory(url, pool_size=connections)
        migrate(self.engine)
        placeholders = outbox.names.placeholders()
        self.sql = {
            name: sql.format(
                events=placeholders["events"], keys=placeholders["keys"], seqs=placeholders["seqs"]
            )
            for name, sql in SQL.items()
        }

    def close(self) -> None:
        self.engine.dispose()

    def scalar(self, name: str) -> int:
        with self.engine.begin() as conn:
            return int(conn.execute(text(self.sql[name])).scalar_one())

    def statement(self, name: str) -> None:
        with self.engine.begin() as conn:
            conn.execute(text(self.sql[name]))

    def fill(self, events: Iterable[Event]) -> tuple[int, float]:
        """Enqueue ``events`` (truncating first), ``BATCH`` per call; (count, seconds)."""
        self.statement("truncate")
        count = 0
        start = time.perf_counter()
        calls = chunks(events, BATCH)
        while True:
            with self.engine.begin() as conn:
                written = 0
                for batch in calls:
                    self.outbox.enqueue_many(conn, batch)
                    count += len(batch)
                    written += 1
                    if written == CALLS_PER_TRANSACTION:
                        break
            if written < CALLS_PER_TRANSACTION:
                break
        seconds = time.perf_counter() - start
        self.statement("analyze")
        return count, seconds

    def expect_drained(self, count: int, what: str) -> None:
        pending = self.scalar("pending")
        delivered = self.scalar("delivered")
        if pending or delivered != count:
            raise RuntimeError(
                f"{what}: {delivered:,} of {count:,} events delivered, {pending:,} still pending"
            )


@dataclass(frozen=True)
class ProcessRun:
    seconds: float
    cpu_seconds: list[float]
    delivered: list[int]
    #: Each process's summary line (``drained: ...``) and its log lines (warnings up).
    summaries: list[str]
    logs: list[str]


def relay_processes(database_url: str, bootstrap: str, count: int) -> ProcessRun:
    """Start ``count`` ``outbox-kafka relay --drain`` processes at once; wait for all."""
    command = [
        sys.executable,
        "-m",
        "outbox_kafka.cli",
        "relay",
        "--drain",
        "--database-url",
        database_url,
        "--bootstrap-servers",
        bootstrap,
        "--log-level",
        "WARNING",
    ]
    # Only this bench's settings: none from the caller's OUTBOX_* variables.
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    with contextlib.ExitStack() as stack:
        # Files, not pipes: a chatty relay cannot block on a full pipe while we wait.
        outputs = [
            (
                stack.enter_context(tempfile.TemporaryFile()),
                stack.enter_context(tempfile.TemporaryFile()),
            )
            for _ in range(count)
        ]
        start = time.perf_counter()
        processes = [
            subprocess.Popen(command, stdout=out, stderr=err, stdin=subprocess.DEVNULL, env=env)
            for out, err in outputs
        ]
        cpu: list[float] = []
        for process in processes:
            # wait4 gives this child's own CPU time (RUSAGE_CHILDREN would sum them all).
            _, status, usage = os.wait4(process.pid, 0)
            process.returncode = os.waitstatus_to_exitcode(status)
            cpu.append(usage.ru_utime + usage.ru_stime)
        seconds = time.perf_counter() - start
        delivered: list[int] = []
        summaries: list[str] = []
        logs: list[str] = []
        for process, (out, err) in zip(processes, outputs, strict=True):
            out.seek(0)
            err.seek(0)
            log_text = err.read().decode(errors="replace")
            if process.returncode != 0:
                raise RuntimeError(f"relay process exited {process.returncode}: {log_text}")
            summary = out.read().decode().strip()
            words = summary.split()
            delivered.append(int(words[words.index("drained:") + 1]))
            summaries.append(summary)
            logs += log_text.splitlines()
    return ProcessRun(seconds, cpu, delivered, summaries, logs)


def steady_writers(table: Table, events: Sequence[Event], rate: float, writers: int) -> float:
    """Commit ``events`` one per transaction at ``rate``/s; seconds until the last commit.

    Event ``i`` is due at ``start + i / rate`` and is written by thread
    ``i mod writers`` on its own connection, so a slow commit delays only
    that thread's next events, not the schedule.
    """
    enqueue = table.outbox.enqueue_many
    barrier = threading.Barrier(writers + 1)
    ends = [0.0] * writers
    errors: list[BaseException] = []
    start = 0.0

    def writer(index: int) -> None:
        try:
            with table.engine.connect() as conn:
                barrier.wait()
                for i in range(index, len(events), writers):
                    delay = start + i / rate - time.perf_counter()
                    if delay > 0:
                        time.sleep(delay)
                    with conn.begin():
                        enqueue(conn, [events[i]])
                ends[index] = time.perf_counter()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [
        threading.Thread(target=writer, args=(i,), name=f"bench-writer-{i}", daemon=True)
        for i in range(writers)
    ]
    for thread in threads:
        thread.start()
    # The schedule starts a little after every writer has its connection.
    start = time.perf_counter() + 0.05
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return max(ends) - start


class RelayBench:
    def __init__(self, ctx: BenchContext, kafka: Kafka, outbox: Outbox) -> None:
        self.ctx = ctx
        self.kafka = kafka
        self.outbox = outbox
        self.events = ctx.events or (QUICK_EVENTS if ctx.quick else EVENTS)
        self.keys = max(1, self.events // EVENTS_PER_KEY)
        #: Run-by-run ratios, filled in by the sections.
        self.ratios: dict[str, tuple[float, ...]] = {}

    def log(self, message: str) -> None:
        self.ctx.log(f"relay: {message} (load {load_average()})")

    def warm_relay(self, table: Table, **overrides: Any) -> Relay:
        """A relay on ``table`` that has relayed one event, as :meth:`Kafka.producer`.

        The warm-up goes through ``drain()`` (one event to the warm-up topic),
        so it uses nothing but the relay's public API; the table is emptied
        again afterwards, and the relay's metrics include this one cycle.
        """
        relay = Relay(self.kafka.settings(table.url, **overrides))
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

    # 1. Throughput ----------------------------------------------------------

    def workload(self, topic: str) -> Iterator[Event]:
        return events_for(self.events, spread(self.keys), topic)

    def raw_producer(self) -> float:
        topic = self.kafka.new_topic()
        messages = [
            (e.key.encode(), e.value, e.headers)
            for e in map(self.outbox.encode, self.workload(topic))
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

    def naive_loop(self, table: Table) -> float:
        topic = self.kafka.new_topic()
        count, _ = table.fill(self.workload(topic))
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

    def relay_in_process(self, table: Table, samples: Samples) -> float:
        topic = self.kafka.new_topic()
        relay = self.warm_relay(table)
        registry = relay.metrics.registry
        phases = ("claim", "publish", "mark")

        def phase_seconds(phase: str) -> float:
            return registry.get_sample_value(f"outbox_{phase}_duration_seconds_sum") or 0.0

        try:
            count, _ = table.fill(self.workload(topic))
            before = {phase: phase_seconds(phase) for phase in phases}
            cpu = time.process_time()
            start = time.perf_counter()
            report = relay.drain()
            seconds = time.perf_counter() - start
            cpu = time.process_time() - cpu
        finally:
            relay.close()
        if report.delivered != count:
            raise RuntimeError(f"relay x1: delivered {report.delivered:,} of {count:,}")
        table.expect_drained(count, "relay x1")
        for phase in phases:
            total = phase_seconds(phase) - before[phase]
            samples.setdefault(f"phase:{phase}", []).append(total / count * 1e6)
        samples.setdefault("cpu:in-process", []).append(cpu / count * 1e6)
        return count / seconds

    def relay_subprocesses(self, table: Table, processes: int, samples: Samples) -> float:
        topic = self.kafka.new_topic()
        count, _ = table.fill(self.workload(topic))
        run = relay_processes(table.url, self.kafka.bootstrap, processes)
        delivered = sum(run.delivered)
        left = self.left_behind(table, count, delivered, f"relay x{processes}", run)
        samples.setdefault(f"left:x{processes}", []).append(left)
        samples.setdefault(f"cpu:x{processes}", []).append(sum(run.cpu_seconds) / count * 1e6)
        for rank, seconds in enumerate(sorted(run.cpu_seconds, reverse=True)):
            samples.setdefault(f"cpu:x{processes}:{rank}", []).append(seconds)
        samples.setdefault(f"share:x{processes}", []).append(100 * max(run.delivered) / count)
        self.log(
            f"x{processes} subprocesses: {run.seconds:.2f} s, delivered "
            f"{'/'.join(f'{n:,}' for n in run.delivered)}, CPU "
            f"{'/'.join(f'{c:.2f}' for c in run.cpu_seconds)} s"
        )
        return delivered / run.seconds

    def left_behind(
        self, table: Table, count: int, delivered: int, what: str, run: ProcessRun
    ) -> int:
        """Events still pending after the drains exited (checked against the table)."""
        pending = table.scalar("pending")
        if delivered + pending != count or table.scalar("delivered") != delivered:
            raise RuntimeError(
                f"{what}: reported {delivered:,} delivered of {count:,}, "
                f"the table says {table.scalar('delivered'):,} delivered, {pending:,} pending"
            )
        if pending:
            self.log(
                f"{what}: {pending:,} events left pending; {'; '.join(run.summaries)}; "
                + " | ".join(run.logs[:5])
            )
        return pending

    def startup(self, table: Table, samples: Samples) -> float:
        table.statement("truncate")
        run = relay_processes(table.url, self.kafka.bootstrap, 1)
        samples.setdefault("cpu:startup", []).append(run.cpu_seconds[0])
        return run.seconds

    def throughput(self) -> list[Result]:
        ctx = self.ctx
        samples: Samples = {}
        names = {
            "raw": "raw idempotent producer, from memory",
            "naive": f"naive loop (SELECT {BATCH:,}, produce, flush, UPDATE)",
            "relay1": "relay x1, in process: drain()",
            **{f"relay{n}p": f"relay x{n}, subprocesses: --drain" for n in RELAY_PROCESSES},
        }
        with ctx.fresh_database("bench_relay") as url:
            table = Table(ctx, url, self.outbox)
            try:
                for run in range(ctx.runs):
                    self.log(f"throughput run {run + 1}/{ctx.runs}, {self.events:,} events")
                    measure: dict[str, Callable[[], float]] = {
                        "raw": self.raw_producer,
                        "naive": partial(self.naive_loop, table),
                        "relay1": partial(self.relay_in_process, table, samples),
                    }
                    for n in RELAY_PROCESSES:
                        measure[f"relay{n}p"] = partial(self.relay_subprocesses, table, n, samples)
                    for name, fn in measure.items():
                        samples.setdefault(name, []).append(fn())
                    samples.setdefault("startup", []).append(self.startup(table, samples))
            finally:
                table.close()

        def figure(name: str, unit: str, values: Sequence[float], note: str = "") -> Result:
            return Result(NAME, name, unit, tuple(values), self.keys, note=note)

        results = [figure(names[n], "events/s", samples[n]) for n in names]
        results += [
            figure(
                "relay x1 subprocess, empty outbox: start-up to exit",
                "s",
                samples["startup"],
                note=f"CPU {statistics.median(samples['cpu:startup']):.2f} s",
            ),
            figure(
                "relay x1 in process: CPU per event (all threads)",
                "µs/event",
                samples["cpu:in-process"],
            ),
        ]
        results += [
            figure(
                f"relay x{n} subprocesses: CPU per event (sum)",
                "µs/event",
                samples[f"cpu:x{n}"],
                note="CPU s per process, busiest first: "
                + " / ".join(
                    f"{statistics.median(samples[f'cpu:x{n}:{rank}']):.2f}" for rank in range(n)
                ),
            )
            for n in RELAY_PROCESSES
        ]
        results += [
            figure(f"relay x{n}: share of the busiest process", "%", samples[f"share:x{n}"])
            for n in RELAY_PROCESSES
            if n > 1
        ]
        results += [
            figure(
                f"relay x{n}: events left pending at exit",
                "events",
                samples[f"left:x{n}"],
                note="still pending after every process exited (the log has each one's "
                "summary); events/s counts delivered events",
            )
            for n in RELAY_PROCESSES
            if any(samples[f"left:x{n}"])
        ]
        results += [
            figure(f"relay x1 in process: {label} per event", "µs/event", samples[f"phase:{phase}"])
            for phase, label in (
                ("claim", "claim"),
                ("publish", "publish (check + produce + flush)"),
                ("mark", "finish statement"),
            )
        ]
        self.ratios |= {
            "vs naive": paired_ratios(samples["relay1"], samples["naive"]),
            "vs raw": paired_ratios(samples["relay1"], samples["raw"]),
            "x2 vs x1 subprocess": paired_ratios(samples["relay2p"], samples["relay1p"]),
            "x2 vs x1 in process": paired_ratios(samples["relay2p"], samples["relay1"]),
        }
        if 4 in RELAY_PROCESSES:
            self.ratios["x4 vs x1 subprocess"] = paired_ratios(
                samples["relay4p"], samples["relay1p"]
            )
        return results

    # 2. Hot key -------------------------------------------------------------

    def claim_cycle(self, table: Table, store: Store, calls: int, expect: int) -> float:
        """Median seconds of ``calls`` claims of BATCH, each undone before the next."""
        times: list[float] = []
        for _ in range(calls):
            start = time.perf_counter()
            claim = store.claim(batch_size=BATCH, lease_seconds=30.0)
            times.append(time.perf_counter() - start)
            if claim.event_count != expect:
                raise RuntimeError(f"claim returned {claim.event_count} events, not {expect}")
            table.statement("release_keys")
        return statistics.median(times)

    def hot_claim(self) -> list[Result]:
        ctx = self.ctx
        backlog = HOT_BACKLOG if not ctx.quick else QUICK_HOT_BACKLOG
        total = backlog + OTHER_KEYS
        calls = QUICK_CLAIM_CALLS if ctx.quick else CLAIM_CALLS
        topic = self.kafka.new_topic()
        samples: Samples = {"hot": [], "uniform": []}
        fills: dict[str, float] = {}

        def hot_key(i: int) -> str:
            return "customer-hot" if i < backlog else f"customer-{i - backlog:05d}"

        with contextlib.ExitStack() as stack:
            tables: dict[str, Table] = {}
            stores: dict[str, Store] = {}
            for shape, key_of in (("hot", hot_key), ("uniform", spread(OTHER_KEYS))):
                url = stack.enter_context(ctx.fresh_database(f"bench_relay_{shape}"))
                table = tables[shape] = Table(ctx, url, self.outbox)
                stack.callback(table.close)
                self.log(f"filling the {shape} table with {total:,} events")
                count, seconds = table.fill(events_for(total, key_of, topic))
                fills[shape] = count / seconds
                self.log(f"{shape} fill: {count:,} events in {seconds:.1f} s")
                store = stores[shape] = Store(url, self.outbox.names)
                stack.callback(store.close)
                self.claim_cycle(table, store, 2, BATCH)  # warm-up
            for run in range(ctx.runs):
                self.log(f"claim run {run + 1}/{ctx.runs}")
                for shape in ("hot", "uniform"):
                    samples[shape].append(
                        self.claim_cycle(tables[shape], stores[shape], calls, BATCH) * 1e3
                    )
        self.ratios["hot claim"] = paired_ratios(samples["hot"], samples["uniform"])
        note = f"median of {calls} claims per run"
        return [
            Result(
                NAME,
                f"claim {BATCH:,}: {backlog:,} on one key + 1 on each of {OTHER_KEYS:,} keys",
                "ms",
                tuple(samples["hot"]),
                OTHER_KEYS + 1,
                note=note,
            ),
            Result(
                NAME,
                f"claim {BATCH:,}: {total:,} spread over {OTHER_KEYS:,} keys",
                "ms",
                tuple(samples["uniform"]),
                OTHER_KEYS,
                note=note,
            ),
            *(
                Result(
                    NAME,
                    f"fill of the {shape} table (enqueue_many, {BATCH:,} per call)",
                    "events/s",
                    (rate,),
                    OTHER_KEYS + (shape == "hot"),
                    note=f"{total:,} events, once",
                )
                for shape, rate in fills.items()
            ),
        ]

    def hot_drain(self) -> list[Result]:
        ctx = self.ctx
        count = QUICK_HOT_DRAIN_EVENTS if ctx.quick else HOT_DRAIN_EVENTS
        samples: Samples = {"hot": [], "uniform": []}
        shapes = {"hot": 1, "uniform": OTHER_KEYS}
        with ctx.fresh_database("bench_relay_drain") as url:
            table = Table(ctx, url, self.outbox)
            try:
                for run in range(ctx.runs):
                    self.log(f"hot-key drain run {run + 1}/{ctx.runs}, {count:,} events")
                    for shape, keys in shapes.items():
                        topic = self.kafka.new_topic()
                        relay = self.warm_relay(table)
                        try:
                            filled, _ = table.fill(events_for(count, spread(keys), topic))
                            start = time.perf_counter()
                            report = relay.drain()
                            seconds = time.perf_counter() - start
                        finally:
                            relay.close()
                        if report.delivered != filled:
                            raise RuntimeError(f"hot drain: {report.delivered} of {filled}")
                        table.expect_drained(filled, f"{shape} drain")
                        samples[shape].append(filled / seconds)
            finally:
                table.close()
        self.ratios["hot throughput"] = paired_ratios(samples["hot"], samples["uniform"])
        return [
            Result(
                NAME,
                f"relay x1 drain, {count:,} events on {keys:,} key{'s' if keys > 1 else ''}",
                "events/s",
                tuple(samples[shape]),
                keys,
            )
            for shape, keys in shapes.items()
        ]

    # 3. Latency -------------------------------------------------------------

    def latency_run(self, table: Table, listen: bool) -> tuple[float, ...]:
        """(achieved rate, p50, p90, p99, max in ms) for one steady-rate run."""
        seconds = QUICK_LATENCY_SECONDS if self.ctx.quick else LATENCY_SECONDS
        count = int(LATENCY_RATE * seconds)
        topic = self.kafka.new_topic()
        events = list(events_for(count, spread(LATENCY_KEYS), topic))
        relay = self.warm_relay(table, listen=listen)
        failure: list[BaseException] = []

        def run_relay() -> None:
            try:
                relay.run()
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=run_relay, name="bench-relay", daemon=True)
        thread.start()
        try:
            deadline = time.monotonic() + 30
            while relay.last_cycle_at is None and time.monotonic() < deadline and not failure:
                time.sleep(0.01)
            elapsed = steady_writers(table, events, LATENCY_RATE, LATENCY_WRITERS)
            deadline = time.monotonic() + CATCH_UP_SECONDS
            while table.scalar("pending") and time.monotonic() < deadline and not failure:
                time.sleep(0.05)
        finally:
            relay.stop()
            thread.join(60)
        if failure:
            raise failure[0]
        table.expect_drained(count, f"latency, listen {'on' if listen else 'off'}")
        with table.engine.connect() as conn:
            delivered, p50, p90, p99, top = conn.execute(text(table.sql["latency"])).one()
        if delivered != count:
            raise RuntimeError(f"latency: {delivered} of {count} events delivered")
        return (count / elapsed, *(1e3 * float(v) for v in (p50, p90, p99, top)))

    def latency(self) -> list[Result]:
        ctx = self.ctx
        results: list[Result] = []
        modes = {"on": True, "off": False}
        samples: dict[str, list[tuple[float, ...]]] = {mode: [] for mode in modes}
        with ctx.fresh_database("bench_relay_latency") as url:
            table = Table(ctx, url, self.outbox, connections=LATENCY_WRITERS + 2)
            try:
                for run in range(ctx.runs):
                    for mode, listen in modes.items():
                        self.log(f"latency run {run + 1}/{ctx.runs}, LISTEN {mode}")
                        samples[mode].append(self.latency_run(table, listen))
            finally:
                table.close()
        labels = ("writer rate achieved", "commit→ack p50", "p90", "p99", "max")
        for mode in modes:
            rows = samples[mode]
            for index, label in enumerate(labels):
                values = tuple(row[index] for row in rows)
                note = ""
                if label == "p99" and mode == "on":
                    met = statistics.median(values) <= TARGET_P99_MS
                    note = f"target ≤ {TARGET_P99_MS:.0f} ms: {'met' if met else 'NOT met'}"
                results.append(
                    Result(
                        NAME,
                        f"{LATENCY_RATE:,}/s, LISTEN {mode}: {label}",
                        "events/s" if index == 0 else "ms",
                        values,
                        LATENCY_KEYS,
                        note=note,
                    )
                )
        return results


def ratio(
    measurement: str, values: Sequence[float], target: float, at_most: bool = False
) -> Result:
    median = statistics.median(values)
    met = median <= target if at_most else median >= target
    sign = "≤" if at_most else "≥"
    return Result(
        NAME,
        measurement,
        "x",
        tuple(values),
        note=f"target {sign} {target:g}x: {'met' if met else 'NOT met'}",
    )


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError(
            "the relay bench needs Kafka (--bootstrap-servers or the embedded broker)"
        )
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    kafka = Kafka(ctx.bootstrap_servers)
    bench = RelayBench(ctx, kafka, outbox)
    results = bench.throughput()
    results += bench.hot_claim()
    results += bench.hot_drain()
    results += bench.latency()
    r = bench.ratios
    results += [
        ratio("relay x1 ÷ naive loop", r["vs naive"], TARGET_VS_NAIVE),
        ratio("relay x1 ÷ raw producer", r["vs raw"], TARGET_VS_RAW),
        ratio("relay x2 ÷ relay x1 (both subprocesses)", r["x2 vs x1 subprocess"], TARGET_SCALING),
        Result(NAME, "relay x2 subprocesses ÷ relay x1 in process", "x", r["x2 vs x1 in process"]),
    ]
    if "x4 vs x1 subprocess" in r:
        results.append(
            Result(NAME, "relay x4 ÷ relay x1 (both subprocesses)", "x", r["x4 vs x1 subprocess"])
        )
    results += [
        ratio("hot-key claim ÷ uniform claim", r["hot claim"], TARGET_HOT_CLAIM, at_most=True),
        ratio("hot-key drain ÷ uniform drain", r["hot throughput"], TARGET_HOT_THROUGHPUT),
    ]
    sample = outbox.encode(next(events_for(1, spread(1), "t")))
    ctx.notes += [
        f"relay: `{EVENT_TYPE}` events, {len(sample.value)}-byte CloudEvents value, "
        f"{len(sample.headers)} headers (the producer bench's payload of ~{PAYLOAD_BYTES} B); "
        f"a fresh topic of {PARTITIONS} partitions per measurement; relays with "
        "RelaySettings defaults (batch 1,000, linger.ms 5, acks=all, idempotence)",
        f"relay: throughput tables hold {bench.events:,} events over {bench.keys:,} keys "
        f"({EVENTS_PER_KEY} per key), filled untimed by enqueue_many ({BATCH:,} per call, "
        f"{CALLS_PER_TRANSACTION} calls per transaction) and ANALYZEd; raw producer, naive "
        "loop and in-process relays have delivered one warm-up message (to another topic) "
        "before the clock starts",
        "relay: `relay xK, subprocesses` is K `python -m outbox_kafka.cli relay --drain` "
        "started at once, wall time until the last exits (start-up included, see the "
        "empty-outbox row); CPU from os.wait4 per process; a drain exits when its claim finds "
        "nothing due, so a relay that finds every key leased by the others stops early",
        "relay: claim = Store.claim(batch_size=1,000), undone between calls by resetting "
        "claim_token/due_at; both tables filled once with the same number of events",
        f"relay: latency = {LATENCY_RATE:,} single-event transactions/s over {LATENCY_KEYS:,} "
        f"keys, written by {LATENCY_WRITERS} threads (own connections) on one perf_counter "
        "schedule, with Relay.run() in another thread of the same process (they share the "
        "GIL); delivered_at - created_at of every event on the database clock; "
        "LISTEN off polls every 0.5 s (the default)",
    ]
    return results
