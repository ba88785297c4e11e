"""Hot keys: throughput and claim time with uniform keys, one hot key, and a hot backlog ahead.

Three tables of ``order.paid`` events (200 B of data), filled once on the
server (:meth:`bench.tables.Table.fill_server_side`: valid envelopes, the
rows ``enqueue_many`` would write) and reset after every run:

* ``uniform``: :data:`EVENTS` events over :data:`OTHER_KEYS` keys;
* ``one hot key``: :data:`EVENTS` events on one key;
* ``hot backlog``: :data:`BACKLOG` events on one key, queued first, ahead of
  :data:`EVENTS` events over :data:`OTHER_KEYS` other keys.

Per run and table: the claim (``Store.claim`` of 1,000, undone between calls),
then a throughput window: ``Relay.run()`` in a thread, started behind the
key-queue lock (:meth:`~bench.tables.Table.start_gate`) so its start-up is
not timed, until Kafka has acknowledged :data:`EVENTS` events (the relay's
``outbox_events_published_total``); events/s over that window.
"""

from __future__ import annotations

import contextlib
import statistics
import threading
import time
from dataclasses import dataclass

from outbox_kafka import Outbox
from outbox_kafka.relay import Relay
from outbox_kafka.relay.store import Store

from .broker import Kafka
from .common import (
    BenchContext,
    PlotPoint,
    Result,
    Target,
    as_in_a_relay_process,
    load_average,
    paired_ratios,
)
from .producer import ROUTES, SCHEMA_DIR
from .tables import ServerFill, Table
from .workload import HOT_KEY

NAME = "hotkey"
EVENTS = 20_000
QUICK_EVENTS = 5_000
BACKLOG = 500_000
QUICK_BACKLOG = 50_000
OTHER_KEYS = 1_000
#: Claims per run of a claim measurement (the run's figure is their median).
CLAIM_CALLS = 9
QUICK_CLAIM_CALLS = 5
BATCH = 1_000
#: After the relay waits at the gate: time for its producer to connect and get an id.
GRACE_SECONDS = 0.5
WINDOW_TIMEOUT = 300.0

#: The tables, in the order they are measured in every run.
SHAPES = ("uniform", "single", "backlog")

TARGET_THROUGHPUT = Target(0.5)
TARGET_CLAIM = Target(2.0, at_most=True)


@dataclass
class Shape:
    name: str
    label: str
    fill: ServerFill
    table: Table
    store: Store


class HotKeyBench:
    def __init__(self, ctx: BenchContext, kafka: Kafka, outbox: Outbox) -> None:
        self.ctx = ctx
        self.kafka = kafka
        self.outbox = outbox
        self.events = ctx.events or (QUICK_EVENTS if ctx.quick else EVENTS)
        self.backlog = QUICK_BACKLOG if ctx.quick else BACKLOG
        self.calls = QUICK_CLAIM_CALLS if ctx.quick else CLAIM_CALLS
        self.samples: dict[str, list[float]] = {}
        self.fills: dict[str, float] = {}

    def log(self, message: str) -> None:
        self.ctx.log(f"{NAME}: {message} (load {load_average()})")

    def add(self, name: str, value: float) -> None:
        self.samples.setdefault(name, []).append(value)

    def fills_for(self, topic: dict[str, str]) -> dict[str, tuple[str, ServerFill]]:
        n = self.events
        return {
            "uniform": (
                f"{n:,} events over {OTHER_KEYS:,} keys",
                ServerFill(topic["uniform"], others=n, keys=OTHER_KEYS),
            ),
            "single": (
                f"{n:,} events on one key",
                ServerFill(topic["single"], others=0, keys=1, hot=n),
            ),
            "backlog": (
                f"{self.backlog:,} on one key ahead of {n:,} over {OTHER_KEYS:,} keys",
                ServerFill(topic["backlog"], others=n, keys=OTHER_KEYS, hot=self.backlog),
            ),
        }

    def claim(self, shape: Shape) -> float:
        """Median milliseconds of the run's claims of BATCH, each undone before the next."""
        times: list[float] = []
        for _ in range(self.calls):
            start = time.perf_counter()
            claim = shape.store.claim(batch_size=BATCH, lease_seconds=30.0)
            times.append(time.perf_counter() - start)
            if claim.event_count != BATCH:
                raise RuntimeError(f"claim returned {claim.event_count} events, not {BATCH}")
            shape.table.statement("release_keys")
        return statistics.median(times) * 1e3

    def window(self, shape: Shape) -> float:
        """Events/s until Kafka has acknowledged ``self.events`` events of the table."""
        relay = Relay(self.kafka.settings(shape.table.url))
        registry = relay.metrics.registry
        topic = shape.fill.topic
        failure: list[BaseException] = []

        def total(name: str) -> float:
            """The sum of a counter over all its labels."""
            return sum(
                sample.value
                for family in registry.collect()
                for sample in family.samples
                if sample.name == name
            )

        def published() -> float:
            found = registry.get_sample_value("outbox_events_published_total", {"topic": topic})
            return found or 0.0

        def run_relay() -> None:
            try:
                relay.run()
            except BaseException as exc:
                failure.append(exc)

        thread = threading.Thread(target=run_relay, name="bench-hotkey-relay", daemon=True)
        try:
            with shape.table.start_gate() as gate:
                thread.start()
                gate.wait_for(1, alive=thread.is_alive)
                time.sleep(GRACE_SECONDS)
                start = time.perf_counter()
                gate.open()
                deadline = time.monotonic() + WINDOW_TIMEOUT
                polls = 0
                while (sent := published()) < self.events:
                    polls += 1
                    # Collecting the whole registry is dearer than one sample: now and then.
                    dropped = polls % 100 == 0 and total("outbox_events_discarded_total") > 0
                    if failure or not thread.is_alive() or dropped or time.monotonic() > deadline:
                        raise RuntimeError(
                            f"{shape.name}: {sent:,.0f} events sent, then the relay stopped, "
                            "discarded events or ran out of time"
                        )
                    time.sleep(0.002)
                seconds = time.perf_counter() - start
        finally:
            relay.stop()
            thread.join(60)
        if failure:
            raise failure[0]
        delivered = shape.table.scalar("delivered")
        discarded = shape.table.scalar("discarded")
        if discarded:
            raise RuntimeError(f"{shape.name}: the relay discarded {discarded:,} events")
        if delivered < self.events:
            raise RuntimeError(f"{shape.name}: {delivered:,} recorded of {sent:,.0f} sent")
        if shape.fill.hot and shape.fill.others:
            others = delivered - shape.table.scalar("delivered_of_key", key=HOT_KEY)
            self.add(f"others:{shape.name}", 100 * others / shape.fill.others)
        return sent / seconds

    def measure(self) -> list[Shape]:
        ctx = self.ctx
        shapes: list[Shape] = []
        with contextlib.ExitStack() as stack:
            topics = {name: stack.enter_context(self.kafka.topic()) for name in SHAPES}
            for name, (label, fill) in self.fills_for(topics).items():
                url = stack.enter_context(ctx.fresh_database(f"bench_hotkey_{name}"))
                table = Table(ctx, url, self.outbox)
                stack.callback(table.close)
                self.log(f"filling {name}: {fill.describe()}")
                self.fills[name] = table.fill_server_side(fill)
                store = Store(url, self.outbox.names)
                stack.callback(store.close)
                shape = Shape(name, label, fill, table, store)
                self.claim(shape)  # warm-up
                shapes.append(shape)
            stack.enter_context(as_in_a_relay_process())
            for run in range(ctx.runs):
                self.log(f"run {run + 1}/{ctx.runs}")
                for shape in shapes:
                    self.add(f"claim:{shape.name}", self.claim(shape))
                for shape in shapes:
                    self.add(f"rate:{shape.name}", self.window(shape))
                    shape.table.reset_delivered()
        return shapes

    def results(self, shapes: list[Shape]) -> list[Result]:
        s = self.samples
        results: list[Result] = []
        plot_labels = {
            "uniform": "uniform\nkeys",
            "single": "one hot\nkey",
            "backlog": "hot backlog\nahead",
        }
        for shape in shapes:
            note = ""
            if f"others:{shape.name}" in s:
                note = (
                    "share of the other keys' events sent in the window: "
                    f"{statistics.median(s[f'others:{shape.name}']):.0f}%"
                )
            results.append(
                Result(
                    NAME,
                    f"relay x1, first {self.events:,} events sent: {shape.label}",
                    "events/s",
                    tuple(s[f"rate:{shape.name}"]),
                    shape.fill.keys + (1 if shape.fill.hot and shape.fill.others else 0),
                    note=note,
                    plot=PlotPoint("throughput", "key shapes, 200 B", plot_labels[shape.name]),
                )
            )
        for shape in shapes:
            results.append(
                Result(
                    NAME,
                    f"claim of {BATCH:,}: {shape.label}",
                    "ms",
                    tuple(s[f"claim:{shape.name}"]),
                    note=f"median of {self.calls} claims per run",
                )
            )
        results += [
            Result(
                NAME,
                "one hot key ÷ uniform keys, events/s",
                "x",
                paired_ratios(s["rate:single"], s["rate:uniform"]),
                target=TARGET_THROUGHPUT,
            ),
            Result(
                NAME,
                f"{self.backlog:,}-event hot backlog ahead ÷ uniform keys, events/s",
                "x",
                paired_ratios(s["rate:backlog"], s["rate:uniform"]),
                target=TARGET_THROUGHPUT,
            ),
            Result(
                NAME,
                f"claim behind the {self.backlog:,}-event hot backlog ÷ claim over uniform keys",
                "x",
                paired_ratios(s["claim:backlog"], s["claim:uniform"]),
                target=TARGET_CLAIM,
            ),
            Result(
                NAME,
                "claim on one hot key ÷ claim over uniform keys",
                "x",
                paired_ratios(s["claim:single"], s["claim:uniform"]),
            ),
        ]
        results += [
            Result(
                NAME,
                f"server-side fill of {shape.label} (+ VACUUM ANALYZE)",
                "s",
                (self.fills[shape.name],),
                note="once, not a measurement of the product",
            )
            for shape in shapes
        ]
        return results


def run(ctx: BenchContext) -> list[Result]:
    if ctx.bootstrap_servers is None:
        raise RuntimeError("the hot-key bench needs Kafka (--bootstrap-servers or embedded)")
    outbox = Outbox(schema_dir=SCHEMA_DIR, routes=ROUTES)
    bench = HotKeyBench(ctx, Kafka(ctx.bootstrap_servers), outbox)
    shapes = bench.measure()
    ctx.notes += [
        "hotkey: the three tables are filled once on the server (INSERT ... SELECT of the rows "
        "enqueue_many would write, from one Outbox.encode template with each row's own "
        "event id and key, so every envelope is valid and sent as is; same data in every "
        "row; the counter and key-queue rows to match; VACUUM ANALYZE after the fill) and "
        "put back after every run (delivered events made pending again, the key queue "
        "rebuilt, VACUUM ANALYZE), untimed; one topic per table for all runs",
        f"hotkey: events/s = events Kafka acknowledged ({bench.events:,}, from the relay's "
        "outbox_events_published_total) over the time from releasing the key-queue lock, "
        "with Relay.run() already waiting at its first claim, to that count; the hot "
        "backlog's window is its first events, and the note says how many of the other "
        "keys' events were among them",
        "hotkey: claim = Store.claim(batch_size=1,000) (1,000 keys x 1 event, or the one "
        "key x 1,000), undone between calls by resetting claim_token/due_at",
    ]
    return bench.results(shapes)
