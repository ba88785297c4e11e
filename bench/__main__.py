"""``python -m bench``: run the registered benches, print the table, write results.md.

Without ``--database-url`` an embedded PostgreSQL is started in a temporary
directory and stopped at the end. Benches that talk to Kafka say so
(``needs_kafka``); for them ``--bootstrap-servers`` is used, or else the
embedded broker is started, only when such a bench is selected.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from outbox_kafka.database import normalise_url, redact_url
from outbox_kafka.embedded import start_broker, start_postgres

from . import producer, relay
from .common import (
    DEFAULT_RUNS,
    QUICK_RUNS,
    RESULTS_PATH,
    BenchContext,
    Result,
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


#: Every bench, in the order they run.
BENCHES: list[Bench] = [
    Bench(
        producer.NAME,
        producer.run,
        "cost per event of enqueue / enqueue_many against plain INSERTs of the same bytes",
    ),
    Bench(
        relay.NAME,
        relay.run,
        "relay throughput against a raw producer and a naive loop, hot-key claims, "
        "commit-to-ack latency",
        needs_kafka=True,
    ),
]


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
        description="Run the registered benches, print the table, write bench/results.md.",
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
    p.add_argument(
        "--only",
        action="append",
        choices=[b.name for b in BENCHES],
        metavar="NAME",
        help=f"run only this bench (repeatable): {', '.join(b.name for b in BENCHES)}",
    )
    p.add_argument(
        "--runs",
        type=positive,
        help=f"runs per measurement (default {DEFAULT_RUNS}, quick {QUICK_RUNS})",
    )
    p.add_argument("--events", type=positive, help="events per measurement (bench default)")
    p.add_argument(
        "--writers",
        type=parse_writers,
        help="concurrent writer counts, comma-separated (default 1,8; quick 1)",
    )
    p.add_argument(
        "--output",
        type=Path,
        default=RESULTS_PATH,
        help="markdown results file (default bench/results.md)",
    )
    return p


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


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(args_list)
    selected = [b for b in BENCHES if not args.only or b.name in args.only]
    runs: int = args.runs or (QUICK_RUNS if args.quick else DEFAULT_RUNS)
    writers: tuple[int, ...] = args.writers or ((1,) if args.quick else (1, 8))

    base = Path(tempfile.mkdtemp(prefix="outbox-kafka-bench-"))
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
                label = "embedded PostgreSQL (outbox_kafka.embedded.start_postgres)"
            bootstrap: str | None = args.bootstrap_servers
            if bootstrap is None and any(b.needs_kafka for b in selected):
                print("starting the embedded broker ...", file=sys.stderr, flush=True)
                broker = start_broker(base)
                stack.callback(broker.stop)
                bootstrap = broker.bootstrap
            ctx = BenchContext(
                server_url=url,
                database_label=label,
                runs=runs,
                quick=args.quick,
                writers=writers,
                events=args.events,
                bootstrap_servers=bootstrap,
            )
            info = machine_info(ctx)
            results: list[Result] = []
            for bench in selected:
                ctx.log(f"== {bench.name}: {bench.description}")
                results += bench.run(ctx)
    finally:
        shutil.rmtree(base, ignore_errors=True)

    print()
    print(f"median of {runs} runs (min, max); {label}")
    print_table(results)
    write_results(args.output, results, ctx, info, command_line(args_list))
    print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
