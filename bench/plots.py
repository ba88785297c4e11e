"""PNG plots of one run's results, drawn with matplotlib's Agg backend (no display needed).

Every bar or point is a figure's median; the whiskers are its min and max
over the runs. The plots are drawn from the :class:`~bench.common.Result`
list alone (their :class:`~bench.common.PlotPoint` tags; the producer
bench's ratios by their unit), so they show exactly what the table shows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import matplotlib.ticker

from .common import Result

Plotter = Callable[[Sequence[Result], Path], bool]


def _whiskers(results: Sequence[Result]) -> list[list[float]]:
    return [[r.median - r.min for r in results], [r.max - r.median for r in results]]


def _series(results: Sequence[Result], figure: str) -> dict[str, list[Result]]:
    found: dict[str, list[Result]] = {}
    for r in results:
        if r.plot is not None and r.plot.figure == figure:
            found.setdefault(r.plot.series, []).append(r)
    return found


def _bars(ax: Any, results: Sequence[Result], labels: Sequence[str], color: str) -> None:
    positions = range(len(results))
    ax.bar(
        positions,
        [r.median for r in results],
        yerr=_whiskers(results),
        capsize=4,
        color=color,
        edgecolor="black",
        linewidth=0.5,
    )
    ax.set_xticks(list(positions), labels, fontsize=8)
    for x, r in zip(positions, results, strict=True):
        ax.annotate(
            r.fmt(r.median),
            (x, r.max),
            textcoords="offset points",
            xytext=(0, 3),
            ha="center",
            fontsize=7,
        )


def _save(fig: Any, path: Path) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def throughput(results: Sequence[Result], path: Path) -> bool:
    groups = _series(results, "throughput")
    if not groups:
        return False
    columns = min(2, len(groups))
    rows = -(-len(groups) // columns)
    fig, grid = plt.subplots(rows, columns, figsize=(6.5 * columns, 4.3 * rows), squeeze=False)
    axes = [[ax for row in grid for ax in row]]
    for ax in axes[0][len(groups) :]:
        ax.set_visible(False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ax, (series, rs)) in enumerate(zip(axes[0], groups.items(), strict=False)):
        _bars(ax, rs, [str(r.plot.x) if r.plot else "" for r in rs], colors[i % len(colors)])
        ax.set_title(series)
        ax.set_ylim(bottom=0, top=max(r.max for r in rs) * 1.12)
        ax.grid(axis="y", alpha=0.3)
        ax.yaxis.set_major_formatter(matplotlib.ticker.StrMethodFormatter("{x:,.0f}"))
        if i % columns == 0:
            ax.set_ylabel("events/s")
    fig.suptitle("Throughput by configuration (median, whiskers: min-max; own scale per panel)")
    _save(fig, path)
    return True


def latency(results: Sequence[Result], path: Path) -> bool:
    series = _series(results, "latency")
    if not series:
        return False
    achieved: dict[tuple[str, float], Result] = {}
    for r in results:
        if r.plot is not None and r.plot.figure == "achieved":
            achieved[(r.plot.series, float(r.plot.x))] = r
    modes = list(dict.fromkeys(name.split("|", 1)[0] for name in series))
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 4.8), squeeze=False)
    for ax, mode in zip(axes[0], modes, strict=True):
        rates: set[float] = set()
        for name, rs in series.items():
            if not name.startswith(mode + "|"):
                continue
            rs = sorted(rs, key=lambda r: float(r.plot.x) if r.plot else 0.0)
            xs = [float(r.plot.x) if r.plot else 0.0 for r in rs]
            rates.update(xs)
            ax.errorbar(
                xs,
                [r.median for r in rs],
                yerr=_whiskers(rs),
                marker="o",
                capsize=4,
                label=name.split("|", 1)[1],
            )
            for r in rs:
                if r.target is not None and r.plot is not None:
                    ax.axhline(r.target.value, color="red", linestyle="--", linewidth=1)
                    ax.annotate(
                        f"target: {name.split('|', 1)[1]} {r.target_text()} "
                        f"at {float(r.plot.x):,.0f}/s",
                        (0.01, r.target.value),
                        xycoords=("axes fraction", "data"),
                        textcoords="offset points",
                        xytext=(0, 3),
                        fontsize=7,
                        color="red",
                    )
        ticks = sorted(rates)
        labels = []
        for rate in ticks:
            got = achieved.get((mode, rate))
            labels.append(
                f"{rate:,.0f}/s asked" + (f"\n{got.median:,.0f}/s achieved" if got else "")
            )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(ticks, labels, fontsize=8)
        ax.minorticks_off()
        ax.set_xlabel("writer rate")
        ax.set_title(mode)
        ax.grid(which="both", alpha=0.3)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("commit→ack, ms (log scale)")
    fig.suptitle("Commit-to-ack latency percentiles by write rate (median, whiskers: min-max)")
    _save(fig, path)
    return True


def backlog(results: Sequence[Result], path: Path) -> bool:
    series = _series(results, "backlog")
    if not series:
        return False
    fig, ax = plt.subplots(figsize=(7, 4.6))
    for name, rs in series.items():
        rs = sorted(rs, key=lambda r: float(r.plot.x) if r.plot else 0.0)
        ax.errorbar(
            [float(r.plot.x) if r.plot else 0.0 for r in rs],
            [r.median for r in rs],
            yerr=_whiskers(rs),
            marker="o",
            capsize=4,
            label=name,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("pending events (log scale)")
    ax.set_ylabel("ms per call (log scale)")
    ax.set_title("Claim and monitoring statements vs backlog size (median, whiskers: min-max)")
    ax.grid(which="both", alpha=0.3)
    ax.legend(fontsize=8)
    _save(fig, path)
    return True


def enqueue(results: Sequence[Result], path: Path) -> bool:
    ratios = [r for r in results if r.bench == "producer" and r.unit == "x"]
    if not ratios:
        return False
    groups: dict[str, list[Result]] = {}
    for r in ratios:
        groups.setdefault(r.measurement, []).append(r)
    fig, axes = plt.subplots(1, len(groups), figsize=(5.5 * len(groups), 4.6), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (ax, (name, rs)) in enumerate(zip(axes[0], groups.items(), strict=True)):
        labels = [
            f"{r.keys:,} key{'s' if (r.keys or 0) > 1 else ''}\n"
            f"{r.writers} writer{'s' if (r.writers or 0) > 1 else ''}"
            for r in rs
        ]
        _bars(ax, rs, labels, colors[i % len(colors)])
        for r in rs[:1]:
            if r.target is not None:
                ax.axhline(r.target.value, color="red", linestyle="--", linewidth=1)
                ax.annotate(
                    f"target {r.target_text()}",
                    (0.01, r.target.value),
                    xycoords=("axes fraction", "data"),
                    textcoords="offset points",
                    xytext=(0, 3),
                    fontsize=7,
                    color="red",
                    backgroundcolor="white",
                )
        ax.set_title(name, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(axis="y", alpha=0.3)
    axes[0][0].set_ylabel("cost ratio (x)")
    fig.suptitle(
        "Producer cost against plain INSERTs of the same bytes (median, whiskers: min-max)"
    )
    _save(fig, path)
    return True


#: (title, file name, plotter), in the order results.md shows them.
PLOTS: tuple[tuple[str, str, Plotter], ...] = (
    ("Throughput by configuration", "throughput.png", throughput),
    ("Commit-to-ack latency by rate, LISTEN on and off", "latency.png", latency),
    ("Claim and oldest-pending query vs backlog size", "backlog.png", backlog),
    ("Enqueue cost ratios", "enqueue.png", enqueue),
)


def write_plots(results: Sequence[Result], directory: Path) -> list[tuple[str, str]]:
    """Draw every plot that has data into ``directory``; (title, file name) of each."""
    written = []
    for title, name, plotter in PLOTS:
        if plotter(results, directory / name):
            written.append((title, name))
    return written
