"""What every bench module shares: the context, timing, result tables, results.md."""

from __future__ import annotations

import contextlib
import os
import platform
import statistics
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import Engine
from sqlalchemy.engine import make_url

from outbox_kafka.database import make_engine, redact_url

#: Runs per measurement; the median is reported with the min and max.
DEFAULT_RUNS = 5
QUICK_RUNS = 2

RESULTS_PATH = Path(__file__).resolve().parent / "results.md"

#: The harness's own statements (benches keep theirs in their own module).
SQL: dict[str, str] = {
    "create_database": 'CREATE DATABASE "{name}"',
    "drop_database": 'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)',
    "server_version": "SHOW server_version",
}

EngineFactory = Callable[..., Engine]


@dataclass(frozen=True)
class Result:
    """One reported figure: ``samples`` holds one value per run."""

    bench: str
    measurement: str
    unit: str
    samples: tuple[float, ...]
    keys: int | None = None
    writers: int | None = None
    note: str = ""

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def max(self) -> float:
        return max(self.samples)

    @property
    def runs(self) -> int:
        return len(self.samples)

    def fmt(self, value: float) -> str:
        if self.unit == "x":
            return f"{value:.2f}x"
        if self.unit == "%":
            return f"{value:.0f}%"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.1f}"


@dataclass
class BenchContext:
    """Everything a bench module's ``run(ctx)`` gets.

    ``server_url`` is a SQLAlchemy URL of a database on the server under test;
    benches create their own databases next to it with :meth:`fresh_database`.
    """

    server_url: str
    database_label: str
    runs: int
    quick: bool
    writers: tuple[int, ...] = (1,)
    events: int | None = None
    bootstrap_servers: str | None = None
    engine_factory: EngineFactory = make_engine
    log: Callable[[str], None] = field(
        default=lambda message: print(message, file=sys.stderr, flush=True)
    )
    #: Lines a bench adds to describe its set-up; they go to results.md.
    notes: list[str] = field(default_factory=list)

    def url_for(self, database: str) -> str:
        return make_url(self.server_url).set(database=database).render_as_string(False)

    def admin_engine(self) -> Engine:
        return sa.create_engine(
            self.server_url, isolation_level="AUTOCOMMIT", poolclass=sa.NullPool
        )

    @contextlib.contextmanager
    def fresh_database(self, prefix: str = "bench") -> Iterator[str]:
        """Create an empty database ``<prefix>_<random>``, yield its URL, drop it."""
        name = f"{prefix}_{uuid.uuid4().hex[:12]}"
        admin = self.admin_engine()
        try:
            with admin.connect() as conn:
                conn.exec_driver_sql(SQL["create_database"].format(name=name))
            try:
                yield self.url_for(name)
            finally:
                with admin.connect() as conn:
                    conn.exec_driver_sql(SQL["drop_database"].format(name=name))
        finally:
            admin.dispose()

    def server_version(self) -> str:
        admin = self.admin_engine()
        try:
            with admin.connect() as conn:
                return str(conn.exec_driver_sql(SQL["server_version"]).scalar_one())
        finally:
            admin.dispose()


def timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn()`` takes, by the monotonic high-resolution clock."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def repeat(measure: Callable[[], float], runs: int) -> list[float]:
    """Call ``measure`` ``runs`` times; one sample per call."""
    return [measure() for _ in range(runs)]


def interleaved(
    measurements: Mapping[str, Callable[[], float]],
    runs: int,
    before_each: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Run every measurement once per round, ``runs`` rounds.

    Interleaving puts a baseline and what is compared with it under the same
    conditions in every round, so their ratio can be taken round by round.
    """
    samples: dict[str, list[float]] = {name: [] for name in measurements}
    for _ in range(runs):
        for name, measure in measurements.items():
            if before_each is not None:
                before_each()
            samples[name].append(measure())
    return samples


def paired_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, ...]:
    """Round-by-round ratios of two interleaved measurements."""
    return tuple(n / d for n, d in zip(numerator, denominator, strict=True))


def machine_info(ctx: BenchContext) -> dict[str, str]:
    def version(dist: str) -> str:
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "CPUs": str(os.cpu_count()),
        "Platform": platform.platform(),
        "PostgreSQL server": ctx.server_version(),
        "Database": ctx.database_label,
        "SQLAlchemy / psycopg2": f"{version('SQLAlchemy')} / {version('psycopg2-binary')}",
        "outbox-kafka": version("outbox-kafka"),
        "Load average (1 min) at start": load_average(),
    }


def load_average() -> str:
    """The 1-minute load average: other work on the machine shows up in the spread."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


_HEADERS = ("Bench", "Measurement", "Keys", "Writers", "Median", "Min", "Max", "Unit", "Note")


def _rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
    return [
        (
            r.bench,
            r.measurement,
            "" if r.keys is None else f"{r.keys:,}",
            "" if r.writers is None else str(r.writers),
            r.fmt(r.median),
            r.fmt(r.min),
            r.fmt(r.max),
            r.unit,
            r.note,
        )
        for r in results
    ]


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned plain-text table."""
    rows = [_HEADERS, *_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADERS))]
    numeric = {2, 3, 4, 5, 6}

    def line(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])


def print_table(results: Sequence[Result]) -> None:
    print(format_table(results), flush=True)


def markdown_table(results: Sequence[Result]) -> str:
    head = "| Bench | Measurement | Keys | Writers | Median | Min-max | Unit | Note |"
    rule = "|---|---|---:|---:|---:|---:|---|---|"
    lines = [head, rule]
    for row in _rows(results):
        bench, measurement, keys, writers, median, low, high, unit, note = row
        lines.append(
            f"| {bench} | {measurement} | {keys} | {writers} | {median} | {low}-{high} "
            f"| {unit} | {note} |"
        )
    return "\n".join(lines)


def write_results(
    path: Path,
    results: Sequence[Result],
    ctx: BenchContext,
    info: Mapping[str, str],
    command: str,
) -> None:
    """Write the results table and the machine it ran on as markdown."""
    info = {**info, "Load average (1 min) at end": load_average()}
    runs = sorted({r.runs for r in results})
    runs_text = " or ".join(str(n) for n in runs) if runs else str(ctx.runs)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines = [
        "# outbox-kafka benchmarks",
        "",
        f"Written by `{command}` on {when}"
        + (" (`--quick`: a smoke run, not a measurement)." if ctx.quick else "."),
        "",
        "## Machine",
        "",
        *(f"- {name}: {value}" for name, value in info.items()),
        "",
        "## Results",
        "",
        f"Every figure is the **median of {runs_text} runs**, with the **min-max** over "
        "those runs. Ratios are taken run by run (the measurements of one run are "
        "interleaved, so a ratio compares figures taken under the same conditions), "
        "then summarised the same way.",
        "",
        markdown_table(results),
        "",
    ]
    if ctx.notes:
        lines += ["## Set-up", "", *(f"- {note}" for note in ctx.notes), ""]
    path.write_text("\n".join(lines), encoding="utf-8")


def describe_url(url: str) -> str:
    return redact_url(url)
