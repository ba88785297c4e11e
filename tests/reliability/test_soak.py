"""A long steady run: nothing that should stay flat grows.

A mixed load runs against one relay process for ``OUTBOX_SOAK_SECONDS``
(120 s in the suite; ``make soak`` runs 1,500 s): a writer commits events at
a steady rate over one hot key and 2,000 cold ones, some of them large
(100 kB), some delayed (``delay=``), a few poison (their stored value is not
an envelope, so the relay discards them); the relay is restarted (SIGTERM, start)
every few minutes, and now and then a REPEATABLE READ transaction stays open
for a while, holding back vacuum. Retention keeps delivered events for 60 s
(20 s in the short run), so the tables reach a steady size.

Every interval the test records throughput, commit-to-ack p99, the relay's
RSS, the sizes of the tables and their indexes, their dead tuples and the
relay's mean claim time. The verdict is about slopes: after a warm-up, a
least-squares line through each figure that should stay flat (the relay's
memory; in the long run also the tables with their indexes) may not climb
by more than its allowance over the run. At the end nothing may be lost, out
of order, or left pending. The figures go to ``soak.md`` and ``soak.png``
in ``OUTBOX_SOAK_OUTPUT`` (``make soak``: ``bench/``, next to the bench
results; else the test's own directory), and the table is printed.
"""

from __future__ import annotations

import os
import random
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import pytest
import sqlalchemy as sa

from outbox_kafka import Event, Outbox
from tests.reliability.harness import Collector, RelayProcess, wait_all_delivered

#: Seconds of load: 120 in the suite, ``make soak`` sets 1,500.
DURATION = float(os.environ.get("OUTBOX_SOAK_SECONDS", "120"))
LONG = DURATION >= 600
INTERVAL = 60.0 if LONG else 15.0
RESTART_EVERY = 240.0 if LONG else 50.0
HOLD_EVERY, HOLD_FOR = (300.0, 60.0) if LONG else (45.0, 15.0)
#: Delivered events are kept this long; retention runs every PURGE_EVERY seconds.
RETAIN, PURGE_EVERY = (60.0, 10.0) if LONG else (20.0, 5.0)
RATE = 200.0
COLD_KEYS = 2_000
LARGE_BYTES = 100_000
#: Where ``make soak`` wants soak.md and soak.png (default: the test's tmp_path).
OUTPUT = os.environ.get("OUTBOX_SOAK_OUTPUT")

SIZES = sa.text(
    "SELECT c.relname, pg_table_size(c.oid), pg_indexes_size(c.oid), "
    "COALESCE(s.n_dead_tup, 0) "
    "FROM pg_class c LEFT JOIN pg_stat_user_tables s ON s.relid = c.oid "
    "WHERE c.relname IN ('outbox', 'outbox_keys', 'outbox_key_seq', 'outbox_arrivals')"
)
DELIVERED = sa.text(
    "SELECT count(*), percentile_cont(0.99) WITHIN GROUP "
    "(ORDER BY EXTRACT(EPOCH FROM delivered_at - created_at)) "
    "FILTER (WHERE available_at <= created_at) "  # p99 of the events due at once
    "FROM outbox WHERE status = 'delivered' AND delivered_at >= :since AND delivered_at < :until"
)


@dataclass
class Sample:
    at: float
    events_per_second: float
    p99_ms: float | None
    rss_mib: float
    table_mib: dict[str, float]
    index_mib: dict[str, float]
    dead: dict[str, int]
    claim_ms: float | None


@dataclass
class MixedWriter:
    """Commits one event per transaction at ``rate``/s, a mix of kinds; keeps the ids."""

    engine: sa.Engine
    topic: str
    rate: float
    #: Ids of the events committed for a real topic, per key, in commit order.
    committed: dict[str, list[str]] = field(default_factory=dict)
    poison: list[str] = field(default_factory=list)
    error: BaseException | None = None

    def __post_init__(self) -> None:
        self.outbox = Outbox(allow_unknown_types=True)
        #: Set to stop writing; stop() also waits for the writer to end.
        self.stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="soak-writer", daemon=True)
        self._rng = random.Random(7)

    def start(self) -> MixedWriter:
        self._thread.start()
        return self

    def _event(self, n: int) -> tuple[Event, bool]:
        rng = self._rng
        key = "hot" if rng.random() < 0.2 else f"cold-{rng.randrange(COLD_KEYS):04d}"
        data: dict[str, object] = {"n": n}
        if rng.random() < 0.005:
            data["pad"] = "x" * LARGE_BYTES
        # Delays on cold keys only: a delayed event holds its key's later events,
        # which on the hot key would be most of the load.
        delayed = key != "hot" and rng.random() < 0.02
        delay = timedelta(seconds=rng.uniform(0.5, 2.0)) if delayed else None
        poison = rng.random() < 0.001
        return Event(type="soak.e", key=key, data=data, topic=self.topic, delay=delay), poison

    def _run(self) -> None:
        started = time.monotonic()
        n = 0
        try:
            while not self.stopping.is_set():
                event, poison = self._event(n)
                with self.engine.begin() as conn:
                    [event_id] = self.outbox.enqueue_many(conn, [event])
                    if poison:
                        # Broken behind the library's back: the relay discards it.
                        conn.execute(
                            sa.text(
                                "UPDATE outbox SET value = convert_to('no envelope', 'UTF8') "
                                "WHERE event_id = :id"
                            ),
                            {"id": event_id},
                        )
                if poison:
                    self.poison.append(str(event_id))
                else:
                    self.committed.setdefault(event.key, []).append(str(event_id))
                n += 1
                self.stopping.wait(max(0.0, started + n / self.rate - time.monotonic()))
        except BaseException as exc:
            self.error = exc
            raise

    def stop(self) -> None:
        self.stopping.set()
        self._thread.join(60)
        assert self.error is None, repr(self.error)


def _rss_mib(relay: RelayProcess) -> float:
    assert relay.process is not None
    status = Path(f"/proc/{relay.process.pid}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


def _claim_totals(relay: RelayProcess) -> tuple[float, float] | None:
    total = relay.metric("outbox_claim_duration_seconds_sum")
    count = relay.metric("outbox_claim_duration_seconds_count")
    return None if total is None or count is None else (total, count)


def _hold_snapshots(engine: sa.Engine, stop: threading.Event) -> None:
    """Every HOLD_EVERY seconds, a REPEATABLE READ transaction open for HOLD_FOR seconds."""
    while not stop.wait(HOLD_EVERY):
        with engine.connect() as conn:
            held = conn.execution_options(isolation_level="REPEATABLE READ")
            with held.begin():
                held.execute(sa.text("SELECT count(*) FROM outbox_keys")).scalar_one()
                stop.wait(HOLD_FOR)


def _slope_per_run(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of ``points`` (seconds, value) times their time span."""
    xs = [x for x, _ in points]
    ys = [y for _, y in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in points) / spread if spread else 0.0
    return slope * (xs[-1] - xs[0])


def _table(samples: list[Sample]) -> str:
    lines = [
        "| minute | events/s | p99 ms | relay RSS MiB | outbox MiB (indexes) | keys MiB (indexes) "
        "| dead tuples outbox / keys / counters | claim ms |",
        "|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for s in samples:
        lines.append(
            f"| {s.at / 60:.1f} | {s.events_per_second:.0f} | "
            f"{'-' if s.p99_ms is None else f'{s.p99_ms:.0f}'} | {s.rss_mib:.0f} | "
            f"{s.table_mib['outbox']:.1f} ({s.index_mib['outbox']:.1f}) | "
            f"{s.table_mib['outbox_keys']:.2f} ({s.index_mib['outbox_keys']:.2f}) | "
            f"{s.dead['outbox']:,} / {s.dead['outbox_keys']:,} / {s.dead['outbox_key_seq']:,} | "
            f"{'-' if s.claim_ms is None else f'{s.claim_ms:.1f}'} |"
        )
    return "\n".join(lines)


def _plot(samples: list[Sample], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [s.at / 60 for s in samples]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    axes[0][0].plot(minutes, [s.events_per_second for s in samples])
    axes[0][0].set_title("delivered events/s")
    axes[0][1].plot(minutes, [s.p99_ms or 0 for s in samples], label="commit→ack p99 (ms)")
    axes[0][1].plot(minutes, [s.claim_ms or 0 for s in samples], label="mean claim (ms)")
    axes[0][1].legend()
    axes[1][0].plot(minutes, [s.rss_mib for s in samples], label="relay RSS")
    for name in ("outbox", "outbox_keys"):
        axes[1][0].plot(
            minutes,
            [s.table_mib[name] + s.index_mib[name] for s in samples],
            label=f"{name} + indexes",
        )
    axes[1][0].set_title("MiB")
    axes[1][0].legend()
    for name in ("outbox", "outbox_keys", "outbox_key_seq"):
        axes[1][1].plot(minutes, [s.dead[name] for s in samples], label=name)
    axes[1][1].set_title("dead tuples")
    axes[1][1].legend()
    for ax in axes[1]:
        ax.set_xlabel("minutes")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


@pytest.mark.timeout(DURATION + 900)
def test_a_steady_mixed_load_leaves_nothing_growing(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
) -> None:
    if LONG:
        with engine.connect() as conn:
            autovacuum = conn.execute(sa.text("SHOW autovacuum")).scalar_one()
        assert autovacuum == "on", (
            "the soak measures what the tables do under vacuum, and this server runs "
            "with autovacuum off: point OUTBOX_TEST_DATABASE_URL at one that has it on, "
            "or unset it for the embedded server"
        )
    topic = new_topic(4)
    relay = RelayProcess(
        database_url,
        kafka_bootstrap,
        tmp_path,
        "soak",
        "--retain-delivered-days",
        str(RETAIN / 86400),
        "--purge-interval",
        str(PURGE_EVERY),
    )
    writer = MixedWriter(engine, topic, RATE)
    collector = Collector(kafka_bootstrap, topic)
    stop_holds = threading.Event()
    holder = threading.Thread(target=_hold_snapshots, args=(engine, stop_holds), daemon=True)
    samples: list[Sample] = []
    restarts = 0
    try:
        relay.start()
        writer.start()
        holder.start()
        started = last = time.monotonic()
        next_restart = started + RESTART_EVERY
        claims = _claim_totals(relay)
        from_db = sa.text("SELECT now()")
        with engine.connect() as conn:
            window_start = conn.execute(from_db).scalar_one()
        while last - started < DURATION:
            collector.read(max(0.1, min(INTERVAL - (time.monotonic() - last), 1.0)))
            now = time.monotonic()
            if now >= next_restart:
                assert relay.stop() == 0, relay.log()[-3000:]
                relay.start()
                restarts += 1
                next_restart = now + RESTART_EVERY
                claims = None
            if now - last < INTERVAL:
                continue
            with engine.connect() as conn:
                window_end = conn.execute(from_db).scalar_one()
                count, p99 = conn.execute(
                    DELIVERED, {"since": window_start, "until": window_end}
                ).one()
                sizes = conn.execute(SIZES).all()
            totals = _claim_totals(relay)
            claim_ms = None
            if claims is not None and totals is not None and totals[1] > claims[1]:
                claim_ms = 1000 * (totals[0] - claims[0]) / (totals[1] - claims[1])
            samples.append(
                Sample(
                    at=now - started,
                    events_per_second=count / (now - last),
                    p99_ms=None if p99 is None else 1000 * float(p99),
                    rss_mib=_rss_mib(relay),
                    table_mib={name: table / 2**20 for name, table, _, _ in sizes},
                    index_mib={name: index / 2**20 for name, _, index, _ in sizes},
                    dead={name: int(dead) for name, _, _, dead in sizes},
                    claim_ms=claim_ms,
                )
            )
            claims, window_start, last = totals, window_end, now
        writer.stop()
        stop_holds.set()
        holder.join(HOLD_FOR + 30)
        wait_all_delivered(engine, 120, relay.log)
        committed = {i for ids in writer.committed.values() for i in ids}
        collector.catch_up(committed, 120)
        assert relay.stop() == 0, relay.log()[-3000:]
    finally:
        writer.stopping.set()
        stop_holds.set()
        relay.stop()
        collector.close()

    table = _table(samples)
    out = Path(OUTPUT) if OUTPUT else tmp_path
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.md").write_text(table + "\n", encoding="utf-8")
    _plot(samples, out / "soak.png")
    print(f"\nsoak: {DURATION:.0f} s, {restarts} relay restarts\n{table}")

    # Nothing lost or out of order (restarts may send a batch twice). Retention
    # has purged most rows by now, so Kafka is compared with the writer's record.
    first_seen: dict[str, list[str]] = {}
    seen: set[str] = set()
    records = sorted(collector.generations[-1], key=lambda r: (r.partition, r.offset))
    for record in records:
        if record.event_id not in seen:
            seen.add(record.event_id)
            assert record.key is not None
            first_seen.setdefault(record.key, []).append(record.event_id)
    assert not committed - seen, f"{len(committed - seen)} committed events never reached Kafka"
    assert first_seen == writer.committed, "a key's events reached Kafka out of commit order"
    assert not seen & set(writer.poison)
    with engine.connect() as conn:
        discarded = set(
            conn.execute(
                sa.text("SELECT CAST(event_id AS text) FROM outbox WHERE status = 'discarded'")
            ).scalars()
        )
    assert discarded <= set(writer.poison)
    assert restarts >= 2
    assert len(samples) >= 6

    # The slopes: after a warm-up (the first quarter: retention has not caught
    # up yet), each figure that should stay flat may climb at most by its
    # allowance over the rest of the run. Two minutes are too short for the
    # tables: autovacuum looks at a database once a minute (the server's
    # autovacuum_naptime), so the short run holds the relay's memory only.
    steady = samples[len(samples) // 4 :]
    allowances: dict[str, tuple[Callable[[Sample], float], float]] = {
        "relay RSS (MiB)": (lambda s: s.rss_mib, 40.0),
        "outbox + indexes (MiB)": (
            lambda s: s.table_mib["outbox"] + s.index_mib["outbox"],
            max(8.0, 0.5 * statistics.fmean(s.table_mib["outbox"] for s in steady)),
        ),
        "key queue + indexes (MiB)": (
            lambda s: s.table_mib["outbox_keys"] + s.index_mib["outbox_keys"],
            2.0,
        ),
        "counters + indexes (MiB)": (
            lambda s: s.table_mib["outbox_key_seq"] + s.index_mib["outbox_key_seq"],
            2.0,
        ),
    }
    if not LONG:
        allowances = {"relay RSS (MiB)": allowances["relay RSS (MiB)"]}
    growth = {
        name: _slope_per_run([(s.at, value(s)) for s in steady])
        for name, (value, _) in allowances.items()
    }
    too_much = {
        name: f"{growth[name]:+.1f} over the run (allowed {allowance:.1f})"
        for name, (_, allowance) in allowances.items()
        if growth[name] > allowance
    }
    assert not too_much, f"{too_much}\n{table}"
