"""Producer-side cost: ``enqueue`` and ``enqueue_many`` against plain INSERTs of the same bytes.

Four measurements per key shape (1 key, 1,000 keys) and writer count, each in
transactions of :data:`BATCH` events, committed, on freshly truncated tables:

* ``plain INSERT, 1 per statement``: one INSERT per event of the exact
  key, topic, value and headers the outbox would store, encoded beforehand;
* ``enqueue``: one :meth:`Outbox.enqueue` call per event;
* ``plain multi-row INSERT``: one INSERT of :data:`BATCH` rows per transaction;
* ``enqueue_many``: one :meth:`Outbox.enqueue_many` call per transaction.

The outbox calls include everything they do for the caller (validation, JSON
encoding, the per-key sequence counter, the key queue, the notify); the
baselines only move the already-encoded bytes (id, key, topic, type, value,
headers: what an outbox row holds of the event). The baselines go straight to
the driver (``exec_driver_sql``): through ``Connection.execute`` the 600 bind
parameters of the multi-row INSERT cost SQLAlchemy about a quarter of that
INSERT's time, overhead of how the baseline passes its rows rather than of
the INSERT. With several writers each thread has its own connection and the
events are split between them.
"""

from __future__ import annotations

import contextlib
import os
import random
import statistics
import string
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Connection, Engine, TextClause, text

from outbox_kafka import Event, Outbox, migrate
from outbox_kafka.stored_headers import headers_to_json

from .common import BenchContext, Result, interleaved, paired_ratios

NAME = "producer"
BATCH = 100
KEY_SHAPES = (1, 1_000)
EVENTS = 5_000
QUICK_EVENTS = 1_000
#: enqueue_many may cost at most this many times the plain multi-row INSERT.
TARGET_RATIO = 2.0
EVENT_TYPE = "order.paid"
SCHEMA_DIR = Path(__file__).resolve().parent.parent / "schemas" / "events"
ROUTES = {"order.*": "orders"}
PAYLOAD_BYTES = 200

#: Every statement this bench runs itself (the outbox's own are in outbox_kafka/sql).
#: ``{events}``, ``{keys}``, ``{seqs}`` and ``{arrivals}`` are the outbox's quoted table names;
#: ``{rows}`` is filled with ``plain_row`` once per row number ``{n}``.
SQL: dict[str, str] = {
    "create_plain_events": """
        CREATE TABLE plain_events (
            id            uuid PRIMARY KEY,
            k             text NOT NULL,
            topic         text NOT NULL,
            type          text NOT NULL,
            value         bytea NOT NULL,
            headers       jsonb NOT NULL,
            created_at    timestamptz DEFAULT now()
        )
    """,
    "truncate": "TRUNCATE {events}, {keys}, {seqs}, {arrivals}, plain_events",
    "plain_insert": """
        INSERT INTO plain_events (id, k, topic, type, value, headers)
        VALUES (:id, :k, :topic, :type, :value, CAST(:headers AS jsonb))
    """,
    "plain_insert_rows": """
        INSERT INTO plain_events (id, k, topic, type, value, headers)
        VALUES {rows}
    """,
    "plain_row": (
        "(:id_{n}, :k_{n}, :topic_{n}, :type_{n}, :value_{n}, CAST(:headers_{n} AS jsonb))"
    ),
}

T = TypeVar("T")
#: Work for one measurement: per writer, its transactions (one batch each).
Plan = list[list[T]]


def statement(name: str, outbox: Outbox) -> TextClause:
    """A statement of :data:`SQL` with the outbox's table names filled in."""
    return text(SQL[name].format_map(outbox.names.placeholders()))


def multirow_statement(rows: int) -> TextClause:
    """The plain multi-row INSERT for ``rows`` rows, parameters suffixed ``_0`` .. ``_<rows-1>``."""
    values = ", ".join(SQL["plain_row"].format(n=n) for n in range(rows))
    return text(SQL["plain_insert_rows"].format(rows=values))


def payload(rng: random.Random, i: int) -> dict[str, Any]:
    """An ``order.paid`` payload of about :data:`PAYLOAD_BYTES` bytes of JSON."""
    alphabet = string.ascii_letters + string.digits
    order_id = f"ord_{i:08d}_" + "".join(rng.choices(alphabet, k=36))
    payment_id = "pay_" + "".join(rng.choices(alphabet, k=84))
    return {
        "order_id": order_id,
        "payment_id": payment_id,
        "amount_cents": rng.randrange(100, 10_000_000),
        "currency": rng.choice(("EUR", "USD", "GBP", "CHF")),
    }


def make_events(count: int, keys: int, seed: int = 42) -> list[Event]:
    """``count`` events; event ``i`` has key ``customer-<i mod keys>``."""
    rng = random.Random(seed)
    return [
        Event(type=EVENT_TYPE, key=f"customer-{i % keys:04d}", data=payload(rng, i))
        for i in range(count)
    ]


def split(events: Sequence[T], writers: int) -> Plan[list[T]]:
    """Cut ``events`` into batches of :data:`BATCH`, dealt to writers in turn."""
    batches = [list(events[i : i + BATCH]) for i in range(0, len(events), BATCH)]
    return [batches[w::writers] for w in range(writers)]


@dataclass(frozen=True)
class Workload:
    """One key shape and writer count, prepared outside the timed region."""

    keys: int
    writers: int
    count: int
    events: Plan[list[Event]]
    #: The same events as encoded by the outbox, as parameters of ``plain_insert``.
    plain_rows: Plan[list[dict[str, Any]]]
    #: The same again as parameters of the multi-row INSERT, one dict per batch.
    plain_batches: Plan[dict[str, Any]]


def prepare(outbox: Outbox, keys: int, writers: int, count: int) -> Workload:
    events = make_events(count, keys)
    rows = []
    for event in events:
        encoded = outbox.encode(event)
        rows.append(
            {
                "id": str(encoded.event_id),
                "k": encoded.key,
                "topic": encoded.topic,
                "type": encoded.type,
                "value": encoded.value,
                "headers": headers_to_json(encoded.headers),
            }
        )
    row_plan = split(rows, writers)
    batch_plan = [
        [
            {f"{column}_{n}": value for n, row in enumerate(batch) for column, value in row.items()}
            for batch in batches
        ]
        for batches in row_plan
    ]
    return Workload(keys, writers, count, split(events, writers), row_plan, batch_plan)


def drive(engine: Engine, plan: Plan[T], do: Callable[[Connection, T], None]) -> float:
    """Seconds for every writer to run its transactions, one thread and connection each.

    Connections are checked out before the clock starts; the clock stops when
    the last writer commits its last transaction.
    """

    def work(conn: Connection, batches: list[T]) -> None:
        for batch in batches:
            with conn.begin():
                do(conn, batch)

    if len(plan) == 1:
        with engine.connect() as conn:
            start = time.perf_counter()
            work(conn, plan[0])
            return time.perf_counter() - start

    barrier = threading.Barrier(len(plan) + 1)
    ends = [0.0] * len(plan)
    errors: list[BaseException] = []

    def writer(index: int) -> None:
        try:
            with engine.connect() as conn:
                barrier.wait()
                work(conn, plan[index])
                ends[index] = time.perf_counter()
        except BaseException as exc:
            errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=writer, args=(i,), daemon=True) for i in range(len(plan))]
    for thread in threads:
        thread.start()
    with contextlib.suppress(threading.BrokenBarrierError):
        barrier.wait()
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    return max(ends) - start


class ProducerBench:
    """The measurements on one migrated database."""

    def __init__(self, outbox: Outbox, engine: Engine) -> None:
        self.outbox = outbox
        self.engine = engine
        # The baselines' statements in the driver's own parameter style.
        self.plain_insert = str(statement("plain_insert", outbox).compile(dialect=engine.dialect))
        self.multirow = str(multirow_statement(BATCH).compile(dialect=engine.dialect))
        self.truncate_statement = statement("truncate", outbox)

    def truncate(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.truncate_statement)

    def plain_per_event(self, load: Workload) -> float:
        def do(conn: Connection, rows: list[dict[str, Any]]) -> None:
            for row in rows:
                conn.exec_driver_sql(self.plain_insert, row)

        return drive(self.engine, load.plain_rows, do) / load.count * 1e6

    def enqueue(self, load: Workload) -> float:
        outbox = self.outbox

        def do(conn: Connection, events: list[Event]) -> None:
            for e in events:
                outbox.enqueue(conn, type=e.type, key=e.key, data=e.data)

        return drive(self.engine, load.events, do) / load.count * 1e6

    def plain_multirow(self, load: Workload) -> float:
        def do(conn: Connection, params: dict[str, Any]) -> None:
            conn.exec_driver_sql(self.multirow, params)

        return drive(self.engine, load.plain_batches, do) / load.count * 1e6

    def enqueue_many(self, load: Workload) -> float:
        outbox = self.outbox

        def do(conn: Connection, events: list[Event]) -> None:
            outbox.enqueue_many(conn, events)

        return drive(self.engine, load.events, do) / load.count * 1e6

    def encode_only(self, load: Workload) -> float:
        """The Python side of ``enqueue_many`` alone: validate and encode, no database."""
        encode = self.outbox.encode
        events = [e for batches in load.events for batch in batches for e in batch]
        start = time.perf_counter()
        for e in events:
            encode(e)
        return (time.perf_counter() - start) / len(events) * 1e6

    def measurements(self, load: Workload) -> dict[str, Callable[[], float]]:
        found: dict[str, Callable[[], float]] = {
            "plain INSERT, 1 per statement": lambda: self.plain_per_event(load),
            "enqueue, 1 per call": lambda: self.enqueue(load),
            f"plain multi-row INSERT ({BATCH} rows)": lambda: self.plain_multirow(load),
            f"enqueue_many ({BATCH} events)": lambda: self.enqueue_many(load),
        }
        if load.writers == 1:
            found["encode only (no database)"] = lambda: self.encode_only(load)
        return found


def total_events(requested: int, writers: int) -> int:
    """``requested`` rounded up so that every writer gets the same number of batches."""
    step = writers * BATCH
    return max(step, -(-requested // step) * step)


def run(ctx: BenchContext) -> list[Result]:
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    requested = ctx.events or (QUICK_EVENTS if ctx.quick else EVENTS)
    costs: list[Result] = []
    ratios: list[Result] = []
    sample = outbox.encode(make_events(1, 1)[0])
    data_bytes = len(_data_json(sample.value))
    with ctx.fresh_database() as url:
        engine = ctx.engine_factory(url, pool_size=max(ctx.writers) + 1)
        try:
            migrate(engine)
            with engine.begin() as conn:
                conn.execute(statement("create_plain_events", outbox))
            bench = ProducerBench(outbox, engine)
            for writers in ctx.writers:
                count = total_events(requested, writers)
                for keys in KEY_SHAPES:
                    ctx.log(f"producer: {keys:,} key(s), {writers} writer(s), {count:,} events")
                    c, r = measure_shape(ctx, bench, outbox, keys, writers, count)
                    costs += c
                    ratios += r
        finally:
            engine.dispose()
    counts = sorted({total_events(requested, w) for w in ctx.writers})
    ctx.notes += [
        f"producer: `{EVENT_TYPE}` events, {data_bytes} bytes of JSON data, "
        f"{len(sample.value)}-byte CloudEvents value, {len(sample.headers)} headers; "
        f"Outbox(schema_dir='schemas/events', routes={ROUTES}) with its defaults (notify on)",
        f"producer: {' / '.join(f'{n:,}' for n in counts)} events per measurement "
        f"(rounded up so every writer gets whole transactions of {BATCH}), "
        "every transaction committed; tables truncated before every measurement; "
        "one untimed warm-up pass per configuration",
        "producer: the plain INSERTs store the same id, key, topic, type, value and header "
        "bytes (from `Outbox.encode`, computed before the clock starts) in `plain_events` "
        "(primary key only); the multi-row one is a single `INSERT ... VALUES` of "
        f"{BATCH} rows; both go straight to the driver (`exec_driver_sql`), so SQLAlchemy's "
        "processing of their bind parameters is not counted",
        "producer: 1,000 keys means event i has key i mod 1,000; several writers each use "
        "their own connection and thread, the batches dealt to them in turn, and the cost "
        "per event is wall time over all events",
        "producer: `encode only` is `Outbox.encode` per event without a database: the "
        "Python share of `enqueue_many`",
    ]
    cpus = os.cpu_count() or 1
    if max(ctx.writers) > cpus:
        ctx.notes.append(
            f"producer: {max(ctx.writers)} writers on {cpus} CPUs, shared with the server: "
            "those figures include contention for the CPUs, not only for the database"
        )
    return costs + ratios


def _data_json(value: bytes) -> bytes:
    """The ``data`` member of an encoded envelope (it is spliced in last)."""
    return value[value.index(b',"data":') + len(b',"data":') : -1]


def measure_shape(
    ctx: BenchContext, bench: ProducerBench, outbox: Outbox, keys: int, writers: int, count: int
) -> tuple[list[Result], list[Result]]:
    warm_up = prepare(outbox, keys, writers, total_events(2 * writers * BATCH, writers))
    for measure in bench.measurements(warm_up).values():
        bench.truncate()
        measure()
    load = prepare(outbox, keys, writers, count)
    samples = interleaved(bench.measurements(load), ctx.runs, before_each=bench.truncate)
    bench.truncate()

    def cost(name: str) -> Result:
        return Result(NAME, name, "µs/event", tuple(samples[name]), keys, writers)

    costs = [cost(name) for name in samples]
    per_event = paired_ratios(
        samples["enqueue, 1 per call"], samples["plain INSERT, 1 per statement"]
    )
    many = paired_ratios(
        samples[f"enqueue_many ({BATCH} events)"], samples[f"plain multi-row INSERT ({BATCH} rows)"]
    )
    met = statistics.median(many) <= TARGET_RATIO
    ratios = [
        Result(NAME, "enqueue ÷ plain INSERT per event", "x", per_event, keys, writers),
        Result(
            NAME,
            "enqueue_many ÷ plain multi-row INSERT",
            "x",
            many,
            keys,
            writers,
            note=f"target ≤ {TARGET_RATIO:.1f}x: {'met' if met else 'NOT met'}",
        ),
    ]
    if "encode only (no database)" in samples:
        share = tuple(
            100 * s
            for s in paired_ratios(
                samples["encode only (no database)"], samples[f"enqueue_many ({BATCH} events)"]
            )
        )
        ratios.append(
            Result(NAME, "encode only ÷ enqueue_many (Python share)", "%", share, keys, writers)
        )
    return costs, ratios
