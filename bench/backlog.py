"""Backlog size: claim and monitoring statements at 10,000 and 1,000,000 pending events.

Two tables of pending ``order.paid`` events (200 B of data), :data:`PER_KEY`
per key (1,000 and 100,000 keys), filled once on the server
(:meth:`bench.tables.Table.fill_server_side`) and VACUUM ANALYZEd. Per run
and table, interleaved:

* the claim: ``Store.claim`` of 1,000 events, undone between calls;
* a sample: one ``backlog_slice`` statement (what the backlog sampler runs
  per tick for ``outbox_pending_events``, ``outbox_oldest_pending_age_seconds``
  and ``outbox_parked_keys``), from the first key, on a pooled connection,
  round trip included. It reads at most ``SLICE_KEYS`` keys of each table, so
  it is expected to stay flat;
* a sweep: ``Monitor.sweep``, every slice of the backlog one after another
  (without the sampler's pauses between them), and how many statements it
  took: the gauges' whole refresh, expected to grow with the keys.

The figure of a run is the median of its calls. The cost of a statement
that stays flat has a 1M / 10k ratio near 1.
"""

from __future__ import annotations

import contextlib
import statistics
import time
from typing import Any

from sqlalchemy import Engine, TextClause

from outbox_kafka import Outbox
from outbox_kafka.relay.metrics import SLICE_KEYS, SLICE_PAUSE, Monitor
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


def time_statement(
    engine: Engine, statement: TextClause, calls: int, params: dict[str, Any] | None = None
) -> float:
    """Median milliseconds of ``calls`` executions (fetching the one row), each committed."""
    times = []
    with engine.connect() as conn:
        for _ in range(calls):
            start = time.perf_counter()
            conn.execute(statement, params or {}).one()
            conn.commit()
            times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def sweep_ms(monitor: Monitor, calls: int) -> tuple[float, int]:
    """Median milliseconds of ``calls`` whole sweeps, and the statements one takes."""
    times = []
    statements = 0
    for _ in range(calls):
        start = time.perf_counter()
        statements = monitor.sweep(timeout=60.0).slices
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3, statements


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
    sample = queries["backlog_slice"]
    sample_params = {"after_key": "", "slice_keys": SLICE_KEYS}
    sweep_calls = max(3, query_calls // 10)
    sweep_statements: dict[int, int] = {}
    samples: dict[str, list[float]] = {}
    fills: dict[int, float] = {}
    with contextlib.ExitStack() as stack:
        tables: dict[int, tuple[Table, Store]] = {}
        monitors: dict[int, Monitor] = {}
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
            monitors[size] = Monitor(table.engine, outbox.names)
            claim_ms(table, store, 2)  # warm-up
        for run_index in range(ctx.runs):
            ctx.log(f"{NAME}: run {run_index + 1}/{ctx.runs} (load {load_average()})")
            for size, (table, store) in tables.items():
                samples.setdefault(f"claim:{size}", []).append(claim_ms(table, store, claim_calls))
                samples.setdefault(f"sample:{size}", []).append(
                    time_statement(table.engine, sample, query_calls, sample_params)
                )
                took, sweep_statements[size] = sweep_ms(monitors[size], sweep_calls)
                samples.setdefault(f"sweep:{size}", []).append(took)

    results: list[Result] = []
    figures = {
        "claim": (f"claim of {BATCH:,} (Store.claim)", claim_calls),
        "sample": ("backlog sample (one backlog_slice statement)", query_calls),
        "sweep": ("backlog sweep (Monitor.sweep, every slice)", sweep_calls),
    }
    for key, (label, calls) in figures.items():
        for size in sizes:
            note = f"median of {calls} calls per run"
            if key == "sweep":
                note += f"; {sweep_statements[size]} statement(s) of at most {SLICE_KEYS:,} keys"
            results.append(
                Result(
                    NAME,
                    f"{label}, {size:,} pending",
                    "ms",
                    tuple(samples[f"{key}:{size}"]),
                    size // PER_KEY,
                    note=note,
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
                target=None if key == "sweep" else TARGET_FLAT,
                note="reads every queued key, a slice at a time: grows with the keys"
                if key == "sweep"
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
        "between calls; the sample is the named statement backlog_slice of "
        "outbox_kafka/schema/sql/queries.sql (from outbox_kafka.schema.statements.queries_for) "
        f"from the first key, {SLICE_KEYS:,} keys at most, executed and committed on a pooled "
        "connection; the sweep is outbox_kafka.relay.metrics.Monitor.sweep (the sampler "
        f"pauses {SLICE_PAUSE} s between its statements, not counted here); every figure is "
        "the median of the run's calls, round trip included",
    ]
    return results
