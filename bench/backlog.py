"""Backlog size: claim and monitoring statements at 10,000 and 1,000,000 pending events.

Two tables of pending ``order.paid`` events (200 B of data), :data:`PER_KEY`
per key (1,000 and 100,000 keys), filled once on the server
(:meth:`bench.tables.Table.fill_server_side`) and VACUUM ANALYZEd. Per run
and table, interleaved:

* the claim: ``Store.claim`` of 1,000 events, undone between calls;
* ``oldest_pending_age`` (the statement the backlog sampler runs for
  ``outbox_oldest_pending_age_seconds``), from ``queries_for(names)``, on a
  pooled connection, round trip included;
* ``pending_events_estimate`` (the sampler's ``outbox_pending_events``), the
  same way: it reads one row per queued key, so it is expected to grow with
  the number of keys.

The figure of a run is the median of its calls. The cost of a statement
that stays flat has a 1M / 10k ratio near 1.
"""

from __future__ import annotations

import contextlib
import statistics
import time

from sqlalchemy import Engine, TextClause

from outbox_kafka import Outbox
from outbox_kafka.relay.store import Store
from outbox_kafka.schema.statements import queries_for

from .common import BenchContext, PlotPoint, Result, Target, load_average, paired_ratios
from .producer import ROUTES, SCHEMA_DIR
from .tables import ServerFill, Table

NAME = "backlog"
SMALL = 10_000
LARGE = 1_000_000
QUICK_LARGE = 100_000
PER_KEY = 10
BATCH = 1_000
CLAIM_CALLS = 9
QUICK_CLAIM_CALLS = 5
QUERY_CALLS = 51
QUICK_QUERY_CALLS = 11

TARGET_FLAT = Target(2.0, at_most=True)
#: No real topic is needed: nothing is sent.
TOPIC = "bench-backlog"


def time_statement(engine: Engine, statement: TextClause, calls: int) -> float:
    """Median milliseconds of ``calls`` executions (fetching the one row), each committed."""
    times = []
    with engine.connect() as conn:
        for _ in range(calls):
            start = time.perf_counter()
            conn.execute(statement).one()
            conn.commit()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def claim_ms(table: Table, store: Store, calls: int) -> float:
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        claim = store.claim(batch_size=BATCH, lease_seconds=30.0)
        times.append(time.perf_counter() - start)
        if claim.event_count != BATCH:
            raise RuntimeError(f"claim returned {claim.event_count} events, not {BATCH}")
        table.statement("release_keys")
    return statistics.median(times) * 1e3


def run(ctx: BenchContext) -> list[Result]:
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    queries = queries_for(outbox.names)
    large = QUICK_LARGE if ctx.quick else LARGE
    sizes = (SMALL, large)
    claim_calls = QUICK_CLAIM_CALLS if ctx.quick else CLAIM_CALLS
    query_calls = QUICK_QUERY_CALLS if ctx.quick else QUERY_CALLS
    statements = {
        "oldest": ("oldest_pending_age", queries["oldest_pending_age"]),
        "estimate": ("pending_events_estimate", queries["pending_events_estimate"]),
    }
    samples: dict[str, list[float]] = {}
    fills: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        tables: dict[int, tuple[Table, Store]] = {}
        for size in sizes:
            url = stack.enter_context(ctx.fresh_database(f"bench_backlog_{size}"))
            table = Table(ctx, url, outbox)
            stack.callback(table.close)
            ctx.log(f"{NAME}: filling {size:,} pending events (load {load_average()})")
            fills[size] = table.fill_server_side(
                ServerFill(TOPIC, others=size, keys=size // PER_KEY)
            )
            store = Store(url, outbox.names)
            stack.callback(store.close)
            tables[size] = (table, store)
            claim_ms(table, store, 2)  # warm-up
        for run_index in range(ctx.runs):
            ctx.log(f"{NAME}: run {run_index + 1}/{ctx.runs} (load {load_average()})")
            for size, (table, store) in tables.items():
                samples.setdefault(f"claim:{size}", []).append(claim_ms(table, store, claim_calls))
                for key, (_, statement) in statements.items():
                    samples.setdefault(f"{key}:{size}", []).append(
                        time_statement(table.engine, statement, query_calls)
                    )

    results: list[Result] = []
    figures = {
        "claim": (f"claim of {BATCH:,} (Store.claim)", claim_calls),
        **{key: (f"{name} statement", query_calls) for key, (name, _) in statements.items()},
    }
    for key, (label, calls) in figures.items():
        for size in sizes:
            results.append(
                Result(
                    NAME,
                    f"{label}, {size:,} pending",
                    "ms",
                    tuple(samples[f"{key}:{size}"]),
                    size // PER_KEY,
                    note=f"median of {calls} calls per run",
                    plot=PlotPoint("backlog", label, float(size)),
                )
            )
    for key, (label, _) in figures.items():
        results.append(
            Result(
                NAME,
                f"{label}: {large:,} ÷ {SMALL:,} pending",
                "x",
                paired_ratios(samples[f"{key}:{large}"], samples[f"{key}:{SMALL}"]),
                target=None if key == "estimate" else TARGET_FLAT,
                note="reads one row per queued key: grows with the keys"
                if key == "estimate"
                else "",
            )
        )
    results += [
        Result(
            NAME,
            f"server-side fill of {size:,} pending (+ VACUUM ANALYZE)",
            "s",
            (fills[size],),
            size // PER_KEY,
            note="once, not a measurement of the product",
        )
        for size in sizes
    ]
    ctx.notes += [
        f"backlog: {SMALL:,} and {large:,} pending events, {PER_KEY} per key "
        f"({SMALL // PER_KEY:,} and {large // PER_KEY:,} keys), written by one server-side "
        "INSERT ... SELECT each (the rows enqueue_many would write: same columns and sizes, "
        "valid envelopes, per-key sequence numbers, counter and key-queue rows) instead of "
        "enqueue_many, which would take minutes for a million; then VACUUM ANALYZE",
        "backlog: claim = Store.claim(batch_size=1,000) (1,000 keys x 1 event), undone "
        "between calls; oldest_pending_age and pending_events_estimate are the named "
        "statements of outbox_kafka/schema/sql/queries.sql from "
        "outbox_kafka.schema.statements.queries_for, "
        "each executed and committed on a pooled connection; every figure is the median of "
        "the run's calls, round trip included",
    ]
    return results
