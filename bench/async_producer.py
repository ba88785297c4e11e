"""Async producers: ``enqueue_many_async`` on asyncpg against ``enqueue_many`` on psycopg2.

The transaction shape is the producer section's ``enqueue_many``: one writer,
transactions of :data:`BATCH` events, every one committed, on freshly
truncated tables, per key shape (1 key, 1,000 keys). Both sides write the
same events (same keys, same payloads) through the same outbox, each on a
connection checked out before the clock starts:

* ``enqueue_many, psycopg2 (sync)``: ``with conn.begin(): outbox.enqueue_many(conn, batch)``;
* ``enqueue_many_async, asyncpg``: ``async with conn.begin(): await
  outbox.enqueue_many_async(conn, batch)`` on one event loop;
* ``enqueue_many_async, psycopg (async)``: the same on psycopg 3's async
  driver, for reference (no target).

The measurements are interleaved run by run, so each ratio compares figures
taken under the same conditions. The target: ``enqueue_many_async`` on
asyncpg costs at most :data:`TARGET_RATIO` times the synchronous call per
event.
"""

from __future__ import annotations

import asyncio
import functools
import time
from collections.abc import Callable
from importlib import metadata

from sqlalchemy import Connection, Engine, text
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine

from outbox_kafka import Event, Outbox, migrate

from .common import BenchContext, Result, Target, interleaved, paired_ratios
from .producer import BATCH, ROUTES, SCHEMA_DIR, drive, make_events, split

NAME = "async"
KEY_SHAPES = (1, 1_000)
EVENTS = 5_000
QUICK_EVENTS = 1_000
#: enqueue_many_async on asyncpg may cost at most this many times enqueue_many on psycopg2.
TARGET_RATIO = 1.3
TARGET = Target(TARGET_RATIO, at_most=True)

SYNC = "enqueue_many, psycopg2 (sync)"
ASYNCPG = "enqueue_many_async, asyncpg"
PSYCOPG_ASYNC = "enqueue_many_async, psycopg (async)"

#: Every statement this bench runs itself; ``{events}`` and the others are the outbox's
#: quoted table names.
SQL: dict[str, str] = {
    "truncate": "TRUNCATE {events}, {keys}, {seqs}, {arrivals}",
}

#: The async drivers measured, by measurement name.
ASYNC_DRIVERS = {ASYNCPG: "asyncpg", PSYCOPG_ASYNC: "psycopg"}

#: One measurement's work: the transactions, one batch of events each.
Batches = list[list[Event]]


async def write_async(engine: AsyncEngine, outbox: Outbox, batches: Batches) -> float:
    """Seconds to write ``batches``, one committed transaction each, on one connection."""
    async with engine.connect() as conn:
        start = time.perf_counter()
        for batch in batches:
            async with conn.begin():
                await outbox.enqueue_many_async(conn, batch)
        return time.perf_counter() - start


class AsyncProducerBench:
    """The measurements on one migrated database, with one event loop for the async side."""

    def __init__(
        self, outbox: Outbox, engine: Engine, async_engines: dict[str, AsyncEngine]
    ) -> None:
        self.outbox = outbox
        self.engine = engine
        self.async_engines = async_engines
        self.truncate_statement = text(SQL["truncate"].format_map(outbox.names.placeholders()))
        self.runner = asyncio.Runner()

    def close(self) -> None:
        for async_engine in self.async_engines.values():
            self.runner.run(async_engine.dispose())
        self.runner.close()

    def truncate(self) -> None:
        with self.engine.begin() as conn:
            conn.execute(self.truncate_statement)

    def sync_cost(self, batches: Batches) -> float:
        """µs per event of ``enqueue_many`` on psycopg2."""
        outbox = self.outbox

        def do(conn: Connection, events: list[Event]) -> None:
            outbox.enqueue_many(conn, events)

        return drive(self.engine, [batches], do) / _count(batches) * 1e6

    def async_cost(self, name: str, batches: Batches) -> float:
        """µs per event of ``enqueue_many_async`` on the async engine ``name``."""
        seconds = self.runner.run(write_async(self.async_engines[name], self.outbox, batches))
        return seconds / _count(batches) * 1e6

    def measurements(self, batches: Batches) -> dict[str, Callable[[], float]]:
        found: dict[str, Callable[[], float]] = {SYNC: functools.partial(self.sync_cost, batches)}
        for name in self.async_engines:
            found[name] = functools.partial(self.async_cost, name, batches)
        return found


def _version(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _count(batches: Batches) -> int:
    return sum(len(batch) for batch in batches)


def run(ctx: BenchContext) -> list[Result]:
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    requested = ctx.events or (QUICK_EVENTS if ctx.quick else EVENTS)
    count = max(BATCH, -(-requested // BATCH) * BATCH)
    results: list[Result] = []
    with ctx.fresh_database("bench_async") as url:
        engine = ctx.engine_factory(url)
        async_engines = {
            name: create_async_engine(
                make_url(url).set(drivername=f"postgresql+{driver}"), pool_pre_ping=True
            )
            for name, driver in ASYNC_DRIVERS.items()
        }
        bench = AsyncProducerBench(outbox, engine, async_engines)
        try:
            migrate(engine)
            for keys in KEY_SHAPES:
                ctx.log(f"{NAME}: {keys:,} key(s), {count:,} events")
                results += measure_shape(ctx, bench, keys, count)
        finally:
            bench.close()
            engine.dispose()
    ctx.notes += [
        f"{NAME}: the producer section's events and outbox; {count:,} events per measurement "
        f"in committed transactions of {BATCH}, one writer, one connection checked out before "
        "the clock starts; tables truncated before every measurement; one untimed warm-up "
        "pass per configuration",
        f"{NAME}: the async calls run on one event loop (`asyncio.Runner`) kept for the whole "
        "section; SQLAlchemy's async engines (`create_async_engine`) with their defaults "
        "(asyncpg's prepared statement cache on), `pool_pre_ping` as on the sync engine; "
        f"asyncpg {_version('asyncpg')}, psycopg {_version('psycopg')}",
    ]
    return results


def measure_shape(
    ctx: BenchContext, bench: AsyncProducerBench, keys: int, count: int
) -> list[Result]:
    warm_up = split(make_events(2 * BATCH, keys, seed=7), 1)[0]
    for measure in bench.measurements(warm_up).values():
        bench.truncate()
        measure()
    batches = split(make_events(count, keys), 1)[0]
    samples = interleaved(bench.measurements(batches), ctx.runs, before_each=bench.truncate)
    bench.truncate()
    results = [
        Result(NAME, name, "µs/event", tuple(values), keys, 1) for name, values in samples.items()
    ]
    results.append(
        Result(
            NAME,
            "enqueue_many_async on asyncpg ÷ enqueue_many on psycopg2",
            "x",
            paired_ratios(samples[ASYNCPG], samples[SYNC]),
            keys,
            1,
            target=TARGET,
        )
    )
    results.append(
        Result(
            NAME,
            "enqueue_many_async on psycopg (async) ÷ enqueue_many on psycopg2",
            "x",
            paired_ratios(samples[PSYCOPG_ASYNC], samples[SYNC]),
            keys,
            1,
        )
    )
    return results
