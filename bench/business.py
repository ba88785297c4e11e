"""The producer's price per business transaction: one business row plus one event, committed.

Each transaction inserts one ``orders`` row and then either

* ``plain INSERT``: the event's bytes (id, key, topic, type, value, headers,
  as the outbox would store them, encoded beforehand) into ``plain_events``,
  an ordinary table with a primary key only; or
* ``enqueue``: one :meth:`Outbox.enqueue` of the same event, with no relay
  waiting idle (what writers see while relays are busy: no notify); or
* ``enqueue, a relay idle``: the same while a session holds the wake lock as
  an idle relay does and never wakes, so that every commit notifies (what
  writers see while the relays are idle; a real idle relay wakes at the first
  notify and goes busy).

then commits, with ``synchronous_commit`` as the server has it (on by
default; the note says what it was). One writer gives the latency of a
transaction; several writers (threads, one connection each) give committed
transactions per second. The targets: ``enqueue`` at most 1.3 times the plain
transaction's latency with one writer, and at least 0.75 times its
transactions per second with 8 and 16 writers, over 1,000 keys.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg2
from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url

from outbox_kafka import Event, Outbox, migrate

from .common import BenchContext, Result, Target, interleaved, paired_ratios
from .producer import ROUTES, SCHEMA_DIR, drive, prepare, statement

NAME = "business"
KEY_SHAPES = (1_000, 1)
WRITERS = (1, 8, 16)
QUICK_WRITERS = (1, 8)
#: Transactions per measurement, by writer count.
TRANSACTIONS = {1: 2_000, 8: 8_000, 16: 8_000}
QUICK_TRANSACTIONS = {1: 500, 8: 2_000, 16: 2_000}
LATENCY_TARGET = Target(1.3, at_most=True)
THROUGHPUT_TARGET = Target(0.75)

SQL: dict[str, str] = {
    "create_orders": """
        CREATE TABLE orders (
            id          bigserial PRIMARY KEY,
            customer    text NOT NULL,
            amount      bigint NOT NULL,
            created_at  timestamptz NOT NULL DEFAULT now()
        )
    """,
    "insert_order": "INSERT INTO orders (customer, amount) VALUES (%(customer)s, %(amount)s)",
    "truncate_orders": "TRUNCATE orders",
    "synchronous_commit": "SHOW synchronous_commit",
}

#: One transaction's work: the business row's parameters, the event, and the event's
#: bytes as the plain INSERT's parameters.
Item = tuple[dict[str, Any], Event, dict[str, Any]]


class BusinessBench:
    def __init__(self, ctx: BenchContext, engine: Engine, url: str, outbox: Outbox) -> None:
        self.ctx = ctx
        self.engine = engine
        self.url = url
        self.outbox = outbox
        self.plain_insert = str(statement("plain_insert", outbox).compile(dialect=engine.dialect))
        self.truncate_outbox = statement("truncate", outbox)

    def truncate(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.truncate_outbox)
            conn.execute(text(SQL["truncate_orders"]))

    def per_transaction(
        self, plan: list[list[Item]], do: Callable[[Connection, Item], None]
    ) -> float:
        """Seconds per committed transaction over all writers (wall time / transactions)."""

        def transaction(conn: Connection, item: Item) -> None:
            conn.exec_driver_sql(SQL["insert_order"], item[0])
            do(conn, item)

        count = sum(len(items) for items in plan)
        return drive(self.engine, plan, transaction) / count

    def plain(self, plan: list[list[Item]]) -> float:
        insert = self.plain_insert

        def do(conn: Connection, item: Item) -> None:
            conn.exec_driver_sql(insert, item[2])

        return self.per_transaction(plan, do)

    def enqueue(self, plan: list[list[Item]]) -> float:
        outbox = self.outbox

        def do(conn: Connection, item: Item) -> None:
            e = item[1]
            outbox.enqueue(conn, type=e.type, key=e.key, data=e.data)

        return self.per_transaction(plan, do)

    def enqueue_relay_idle(self, plan: list[list[Item]]) -> float:
        with self.idle_relay():
            return self.enqueue(plan)

    @contextmanager
    def idle_relay(self) -> Iterator[None]:
        """A session that listens and holds the wake lock, as an idle relay does."""
        conn = psycopg2.connect(
            make_url(self.url).set(drivername="postgresql").render_as_string(hide_password=False)
        )
        try:
            conn.autocommit = True
            with conn.cursor() as cur:
                cur.execute(f'LISTEN "{self.outbox.names.channel}"')
                cur.execute("SELECT pg_advisory_lock(%s)", (self.outbox.names.wake_lock,))
            yield
        finally:
            conn.close()

    def measure(
        self,
        keys: int,
        writers: int,
        count: int,
        measurements: dict[str, Callable[[list[list[Item]]], float]] | None = None,
    ) -> dict[str, list[float]]:
        """Seconds per transaction of each of ``measurements`` (by default: the plain
        INSERT, ``enqueue`` and ``enqueue`` with a relay idle), interleaved round by round."""
        plans = {size: self.plan(keys, writers, size) for size in (2 * writers, count)}
        if measurements is None:
            measurements = {
                "plain INSERT": self.plain,
                "enqueue": self.enqueue,
                "enqueue, a relay idle (notify on every commit)": self.enqueue_relay_idle,
            }
        for measure in measurements.values():  # warm-up, untimed
            self.truncate()
            measure(plans[2 * writers])
        plan = plans[count]
        return interleaved(
            {name: functools.partial(m, plan) for name, m in measurements.items()},
            self.ctx.runs,
            before_each=self.truncate,
        )

    def plan(self, keys: int, writers: int, count: int) -> list[list[Item]]:
        """Per writer, its transactions, dealt in turn."""
        load = prepare(self.outbox, keys, writers, count)
        plan: list[list[Item]] = []
        for w in range(writers):
            events = [e for batch in load.events[w] for e in batch]
            rows = [r for batch in load.plain_rows[w] for r in batch]
            plan.append(
                [
                    ({"customer": e.key, "amount": 100 + i}, e, row)
                    for i, (e, row) in enumerate(zip(events, rows, strict=True))
                ]
            )
        return plan


def run(ctx: BenchContext) -> list[Result]:
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    writer_counts = QUICK_WRITERS if ctx.quick else WRITERS
    counts = QUICK_TRANSACTIONS if ctx.quick else TRANSACTIONS
    results: list[Result] = []
    with ctx.fresh_database("bench_business") as url:
        engine = ctx.engine_factory(url, pool_size=max(writer_counts) + 1)
        try:
            migrate(engine)
            with engine.begin() as conn:
                conn.execute(statement("create_plain_events", outbox))
                conn.execute(text(SQL["create_orders"]))
                synchronous_commit = conn.exec_driver_sql(SQL["synchronous_commit"]).scalar_one()
            bench = BusinessBench(ctx, engine, url, outbox)
            for writers in writer_counts:
                for keys in KEY_SHAPES:
                    count = ctx.events or counts[writers]
                    count = max(writers, count - count % writers)
                    ctx.log(f"{NAME}: {keys:,} key(s), {writers} writer(s), {count:,} transactions")
                    samples = bench.measure(keys, writers, count)
                    results += _results(samples, keys, writers)
        finally:
            engine.dispose()
    ctx.notes += [
        f"{NAME}: each transaction inserts one `orders` row (bigserial key, text, bigint) and "
        "then one event, and commits; the plain INSERT writes the event's bytes (from "
        "`Outbox.encode`, before the clock starts) into `plain_events` (primary key only) "
        f"through the driver; synchronous_commit = {synchronous_commit}; tables truncated "
        "before every measurement",
        f"{NAME}: `enqueue` runs with no relay waiting idle (no notify: what writers see "
        "while relays are busy); `enqueue, a relay idle` holds the wake lock in another "
        "session that never wakes, so every commit notifies (the cost the wake lock avoids)",
        f"{NAME}: one writer: seconds per transaction; several: each writer a thread with its "
        "own connection, transactions per second = all transactions over the wall time",
    ]
    return results


def _results(samples: dict[str, list[float]], keys: int, writers: int) -> Iterator[Result]:
    plain = samples["plain INSERT"]
    if writers == 1:
        for name, values in samples.items():
            yield Result(NAME, f"{name}: latency", "µs", tuple(v * 1e6 for v in values), keys, 1)
        for name in ("enqueue", "enqueue, a relay idle (notify on every commit)"):
            yield Result(
                NAME,
                f"{name} ÷ plain INSERT: latency",
                "x",
                paired_ratios(samples[name], plain),
                keys,
                1,
                target=LATENCY_TARGET if name == "enqueue" and keys == 1_000 else None,
            )
        return
    for name, values in samples.items():
        yield Result(
            NAME, f"{name}: transactions/s", "tx/s", tuple(1 / v for v in values), keys, writers
        )
    for name in ("enqueue", "enqueue, a relay idle (notify on every commit)"):
        yield Result(
            NAME,
            f"{name} ÷ plain INSERT: transactions/s",
            "x",
            paired_ratios(plain, samples[name]),
            keys,
            writers,
            target=THROUGHPUT_TARGET if name == "enqueue" and keys == 1_000 else None,
        )
