"""What every bench module shares: the context, timing, result tables, results.md."""

from __future__ import annotations

import contextlib
import gc
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
class Target:
    """What a figure should be: at least (or, ``at_most``, at most) ``value``, in its unit."""

    value: float
    at_most: bool = False

    @property
    def sign(self) -> str:
        return "≤" if self.at_most else "≥"

    def met(self, value: float) -> bool:
        return value <= self.value if self.at_most else value >= self.value

    def margin(self, value: float) -> float:
        """How far ``value`` is on the right side of the target, as a fraction of it.

        Positive: met with that much to spare; negative: missed by that much.
        """
        gap = self.value - value if self.at_most else value - self.value
        return gap / abs(self.value) if self.value else gap


@dataclass(frozen=True)
class PlotPoint:
    """Where a figure goes in the PNG plots (:mod:`bench.plots`)."""

    figure: str
    series: str
    x: str | float


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
    target: Target | None = None
    plot: PlotPoint | None = None

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

    @property
    def met(self) -> bool | None:
        return None if self.target is None else self.target.met(self.median)

    def fmt(self, value: float) -> str:
        if self.unit == "x":
            return f"{value:.2f}x"
        if self.unit == "%":
            return f"{value:.0f}%"
        if abs(value) >= 100:
            return f"{value:,.0f}"
        if abs(value) >= 1 or value == 0:
            return f"{value:.1f}"
        return f"{value:.3f}"

    def target_text(self) -> str:
        """``≥ 0.50x`` / ``≤ 100 ms``."""
        if self.target is None:
            return ""
        unit = "" if self.unit in ("x", "%") else f" {self.unit}"
        return f"{self.target.sign} {self.fmt(self.target.value)}{unit}"

    def verdict(self) -> str:
        """``met, +24% to spare (5 of 5 runs)`` / ``MISSED by 12% (1 of 5 runs met it)``."""
        if self.target is None:
            return ""
        margin = self.target.margin(self.median)
        meeting = sum(self.target.met(s) for s in self.samples)
        if self.target.met(self.median):
            return f"met, {margin:+.0%} margin ({meeting} of {self.runs} runs met it)"
        return f"MISSED by {-margin:.0%} ({meeting} of {self.runs} runs met it)"

    def full_note(self) -> str:
        parts = [f"target {self.target_text()}: {self.verdict()}"] if self.target else []
        if self.note:
            parts.append(self.note)
        return "; ".join(parts)


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
    broker_label: str = "none (no bench that needs Kafka ran)"
    engine_factory: EngineFactory = make_engine
    log: Callable[[str], None] = field(default=lambda message: progress(message))
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


_STARTED = time.monotonic()


@contextlib.contextmanager
def as_in_a_relay_process() -> Iterator[None]:
    """The garbage collector as ``outbox-kafka relay`` sets it once it has started:
    what exists now is collected, then frozen out of its sight (``gc.freeze``), so
    that its full collections do not walk the bench's own heap while a relay in this
    process makes and drops a batch's objects; unfrozen after the block. In-process
    relays are timed inside it, and so are the loops they are compared with."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def progress(message: str) -> None:
    """A progress line on stderr, stamped with the minutes and seconds since the start."""
    minutes, seconds = divmod(time.monotonic() - _STARTED, 60)
    print(f"[{int(minutes):02d}:{seconds:04.1f}] {message}", file=sys.stderr, flush=True)


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
        "CPUs": f"{os.cpu_count()} ({cpu_model()})",
        "Memory": memory_total(),
        "Platform": platform.platform(),
        "Python": f"{platform.python_implementation()} {platform.python_version()}",
        "PostgreSQL server": f"{ctx.server_version()}, {ctx.database_label}",
        "Kafka broker": ctx.broker_label,
        "SQLAlchemy / psycopg2 / confluent-kafka": (
            f"{version('SQLAlchemy')} / {version('psycopg2-binary')} / {version('confluent-kafka')}"
        ),
        "outbox-kafka": version("outbox-kafka"),
        "Load average (1 min) at start": load_average(),
    }


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown model"


def memory_total() -> str:
    try:
        with open("/proc/meminfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def load_average() -> str:
    """The 1-minute load average: other work on the machine shows up in the spread."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "unknown"


_HEADERS = (
    "Bench",
    "Measurement",
    "Keys",
    "Writers",
    "Runs",
    "Median",
    "Min",
    "Max",
    "Unit",
    "Note",
)


def _rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
    return [
        (
            r.bench,
            r.measurement,
            "" if r.keys is None else f"{r.keys:,}",
            "" if r.writers is None else str(r.writers),
            str(r.runs),
            r.fmt(r.median),
            r.fmt(r.min),
            r.fmt(r.max),
            r.unit,
            r.full_note(),
        )
        for r in results
    ]


def format_table(results: Sequence[Result]) -> str:
    """The results as an aligned plain-text table."""
    rows = [_HEADERS, *_rows(results)]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_HEADERS))]
    numeric = {2, 3, 4, 5, 6, 7}

    def line(row: tuple[str, ...]) -> str:
        cells = [
            cell.rjust(w) if i in numeric else cell.ljust(w)
            for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        return "  ".join(cells).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(rows[0]), rule, *(line(r) for r in rows[1:])])


def format_targets(results: Sequence[Result]) -> str:
    """One line per figure with a target: the verdict first."""
    lines = []
    for r in results:
        if r.target is not None:
            state = "met   " if r.met else "MISSED"
            lines.append(
                f"{state}  {r.bench}: {r.measurement}"
                + (f" [{r.keys:,} keys]" if r.keys is not None else "")
                + (f" [{r.writers} writers]" if r.writers is not None else "")
                + f" = {r.fmt(r.median)} (target {r.target_text()}; {r.verdict()})"
            )
    return "\n".join(lines)


def print_table(results: Sequence[Result]) -> None:
    print(format_table(results), flush=True)
    targets = format_targets(results)
    if targets:
        print("\ntargets:\n" + targets, flush=True)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def markdown_table(results: Sequence[Result]) -> str:
    head = "| Bench | Measurement | Keys | Writers | Runs | Median | Min-max | Unit | Note |"
    rule = "|---|---|---:|---:|---:|---:|---:|---|---|"
    lines = [head, rule]
    for row in _rows(results):
        bench, measurement, keys, writers, runs, median, low, high, unit, note = map(_cell, row)
        lines.append(
            f"| {bench} | {measurement} | {keys} | {writers} | {runs} | {median} "
            f"| {low}-{high} | {unit} | {note} |"
        )
    return "\n".join(lines)


def markdown_targets(results: Sequence[Result]) -> str:
    head = "| Target | Figure | Median (min-max) | Verdict |"
    rule = "|---|---|---:|---|"
    lines = [head, rule]
    for r in results:
        if r.target is None:
            continue
        shape = ", ".join(
            part
            for part in (
                "" if r.keys is None else f"{r.keys:,} key{'s' if r.keys != 1 else ''}",
                "" if r.writers is None else f"{r.writers} writer{'s' if r.writers != 1 else ''}",
            )
            if part
        )
        figure = f"{r.bench}: {r.measurement}" + (f" ({shape})" if shape else "")
        verdict = r.verdict()
        if not r.met:
            verdict = f"**{verdict}**"
        lines.append(
            f"| {_cell(r.target_text())} | {_cell(figure)} "
            f"| {r.fmt(r.median)} ({r.fmt(r.min)}-{r.fmt(r.max)}) | {_cell(verdict)} |"
        )
    return "\n".join(lines)


@dataclass(frozen=True)
class Report:
    """Everything results.md says besides the figures."""

    command: str
    info: Mapping[str, str]
    #: (title, file name next to results.md) of each PNG plot.
    plots: Sequence[tuple[str, str]] = ()
    #: (section, seconds) in the order they ran.
    section_seconds: Sequence[tuple[str, float]] = ()


def write_results(path: Path, results: Sequence[Result], ctx: BenchContext, report: Report) -> None:
    """Write the targets, the machine, every figure, the plots and the set-up as markdown."""
    info = {**report.info, "Load average (1 min) at end": load_average()}
    runs = sorted({r.runs for r in results})
    runs_text = " or ".join(str(n) for n in runs) if runs else str(ctx.runs)
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    targets = [r for r in results if r.target is not None]
    missed = [r for r in targets if not r.met]
    lines = [
        "# outbox-kafka benchmarks",
        "",
        f"Written by `{report.command}` on {when}"
        + (" (`--quick`: a smoke run at small sizes, not a measurement)." if ctx.quick else "."),
        "",
    ]
    if targets:
        lines += [
            "## Targets",
            "",
            f"{len(targets) - len(missed)} of {len(targets)} met in this run. A target is "
            "judged on the median; the margin is how far the median is on the right side "
            "of the target, as a share of the target (negative: missed), and the count says "
            "how many of the runs met it on their own.",
            "",
            markdown_targets(results),
            "",
        ]
    lines += [
        "## Machine",
        "",
        *(f"- {name}: {value}" for name, value in info.items()),
        "",
        "## Results",
        "",
        f"Every figure is the **median of {runs_text} runs** (the Runs column), with the "
        "**min-max** over those runs. Ratios are taken run by run (the measurements of one "
        "run are interleaved, so a ratio compares figures taken under the same conditions), "
        "then summarised the same way.",
        "",
        markdown_table(results),
        "",
    ]
    if report.plots:
        lines += ["## Plots", ""]
        for title, name in report.plots:
            lines += [f"### {title}", "", f"![{title}]({name})", ""]
    if ctx.notes:
        lines += ["## How each figure is measured", "", *(f"- {note}" for note in ctx.notes), ""]
    if report.section_seconds:
        total = sum(seconds for _, seconds in report.section_seconds)
        lines += [
            "## Time taken",
            "",
            *(f"- {name}: {seconds / 60:.1f} min" for name, seconds in report.section_seconds),
            f"- total: {total / 60:.1f} min",
            "",
        ]
    path.write_text("\n".join(lines), encoding="utf-8")


def describe_url(url: str) -> str:
    return redact_url(url)
