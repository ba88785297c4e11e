"""``make demo``: an orders service, the relay and a consumer, end to end, on embedded services.

Starts embedded PostgreSQL and the embedded Kafka-protocol broker in a
temporary directory, migrates, runs a small orders service that creates, pays
and ships orders in real transactions, relays the events, consumes them and
checks per-key order. Everything is removed at the end, also on Ctrl-C.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from confluent_kafka import Consumer, KafkaError, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_kafka.database import make_engine
from outbox_kafka.demo.embedded import embedded_stack
from outbox_kafka.logs import configure_logging
from outbox_kafka.producer.outbox import Outbox
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.loop import Relay
from outbox_kafka.relay.serve import ObservabilityServer
from outbox_kafka.schema.migrations import migrate
from outbox_kafka.validation import shipped_schema_dir

TOPIC = "orders"
PARTITIONS = 3
STEPS = ("order.created", "order.paid", "order.shipped")
# The demo's own reporting query: write-to-acknowledgement percentiles, database clock.
_LATENCY_SQL = sa.text(
    "SELECT percentile_cont(ARRAY[0.5, 0.9, 0.99]) WITHIN GROUP (ORDER BY s), max(s) "
    "FROM (SELECT EXTRACT(EPOCH FROM delivered_at - created_at) AS s FROM outbox "
    "WHERE status = 'delivered') d"
)
_STATUS_SQL = sa.text("SELECT status, count(*) FROM outbox GROUP BY status ORDER BY status")

_ORDERS_TABLE = sa.Table(
    "orders",
    sa.MetaData(),
    sa.Column("order_id", sa.Text, primary_key=True),
    sa.Column("customer_id", sa.Text, nullable=False),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("total_cents", sa.Integer, nullable=False),
)


@dataclass
class _Tally:
    lock: threading.Lock = field(default_factory=threading.Lock)
    committed_at: dict[str, float] = field(default_factory=dict)
    received: int = 0
    latencies: list[float] = field(default_factory=list)
    order_violations: int = 0
    duplicates: int = 0
    seen_ids: set[str] = field(default_factory=set)
    last_step: dict[str, int] = field(default_factory=dict)


def _payload(step: str, order_id: str, rng: random.Random) -> dict[str, object]:
    if step == "order.created":
        quantity = rng.randint(1, 3)
        price = rng.randint(199, 4999)
        return {
            "order_id": order_id,
            "customer_id": f"c-{rng.randint(1, 50)}",
            "items": [
                {
                    "sku": f"sku-{rng.randint(1, 20)}",
                    "quantity": quantity,
                    "unit_price_cents": price,
                }
            ],
            "total_cents": quantity * price,
            "currency": "EUR",
        }
    if step == "order.paid":
        return {
            "order_id": order_id,
            "payment_id": f"p-{rng.getrandbits(32):08x}",
            "amount_cents": rng.randint(100, 10000),
            "currency": "EUR",
        }
    return {
        "order_id": order_id,
        "carrier": "DHL",
        "tracking_number": f"T{rng.getrandbits(40):010x}",
    }


def _orders_service(
    engine: sa.Engine, outbox: Outbox, order_ids: list[str], tally: _Tally, seed: int
) -> None:
    """Moves each order through created -> paid -> shipped, one transaction per step."""
    rng = random.Random(seed)
    progress = {order_id: 0 for order_id in order_ids}
    while progress:
        order_id = rng.choice(list(progress))
        step = STEPS[progress[order_id]]
        data = _payload(step, order_id, rng)
        with engine.begin() as conn:
            if step == "order.created":
                conn.execute(
                    _ORDERS_TABLE.insert().values(
                        order_id=order_id,
                        customer_id=data["customer_id"],
                        status="created",
                        total_cents=data["total_cents"],
                    )
                )
            else:
                conn.execute(
                    _ORDERS_TABLE.update()
                    .where(_ORDERS_TABLE.c.order_id == order_id)
                    .values(status=step.split(".")[1])
                )
            event_id = outbox.enqueue(conn, type=step, key=order_id, data=data)
        with tally.lock:
            tally.committed_at[str(event_id)] = time.monotonic()
        progress[order_id] += 1
        if progress[order_id] == len(STEPS):
            del progress[order_id]
        time.sleep(rng.random() * 0.004)


def _consume(bootstrap: str, expected: int, tally: _Tally, stop: threading.Event) -> None:
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": "outbox-kafka-demo",
            "enable.auto.commit": False,
        }
    )
    consumer.assign([TopicPartition(TOPIC, p, 0) for p in range(PARTITIONS)])
    try:
        while not stop.is_set() and tally.received < expected:
            msg = consumer.poll(0.2)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() != KafkaError._PARTITION_EOF:
                    print(f"consumer error: {err}", file=sys.stderr)
                continue
            now = time.monotonic()
            envelope = json.loads(msg.value() or b"{}")
            event_id = envelope["id"]
            key = (msg.key() or b"").decode()
            step = STEPS.index(envelope["type"])
            with tally.lock:
                if event_id in tally.seen_ids:
                    tally.duplicates += 1
                    continue
                tally.seen_ids.add(event_id)
                tally.received += 1
                if step != tally.last_step.get(key, -1) + 1:
                    tally.order_violations += 1
                tally.last_step[key] = step
                committed = tally.committed_at.get(event_id)
                if committed is not None:
                    tally.latencies.append(now - committed)
    finally:
        consumer.close()


def _http_status(url: str) -> int:
    """The status code the demo's relay answers ``url`` with (0: no answer)."""
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except OSError:
        return 0


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class _Outcome:
    """What one demo run measured, kept after its Kafka clients are gone."""

    tally: _Tally
    elapsed: float
    latency_row: tuple[Any, ...]
    status: dict[str, int]
    probes: dict[str, int]
    metrics_url: str


def _create_topic(bootstrap: str) -> None:
    # The admin client ends with this call, long before the broker stops: a client
    # still connected then would log the broker's going away as a failure.
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(TOPIC, PARTITIONS, 1)])[TOPIC].result(timeout=30)


def _run_orders(pg_url: str, bootstrap: str, orders: int, writers: int) -> _Outcome | None:
    """The orders service, the relay and the consumer against running services;
    ``None`` when interrupted. Every Kafka client it makes is gone when it returns."""
    engine = make_engine(pg_url, pool_size=writers + 2)
    migrate(engine)
    _ORDERS_TABLE.metadata.create_all(engine)
    _create_topic(bootstrap)

    settings = RelaySettings(database_url=pg_url, bootstrap_servers=bootstrap, poll_interval=0.2)
    relay = Relay(settings)
    server = ObservabilityServer.for_relay(relay, host="127.0.0.1", port=0).start()
    metrics_url = server.url("/metrics")
    print(f"  relay metrics and health: {metrics_url}, /healthz, /readyz")
    relay_thread = threading.Thread(target=relay.run, name="relay", daemon=True)
    relay_thread.start()

    outbox = Outbox(
        schema_dir=Path(shipped_schema_dir()) / "events",
        routes={"order.*": TOPIC},
        source="//demo/orders-service",
    )
    tally = _Tally()
    expected = orders * len(STEPS)
    stop = threading.Event()
    consumer = threading.Thread(
        target=_consume, args=(bootstrap, expected, tally, stop), daemon=True
    )
    consumer.start()
    ids = [f"order-{n:05d}" for n in range(orders)]
    started = time.monotonic()
    producers = [
        threading.Thread(
            target=_orders_service,
            args=(engine, outbox, ids[i::writers], tally, i),
            daemon=True,
        )
        for i in range(writers)
    ]
    for thread in producers:
        thread.start()
    try:
        deadline = started + 120
        while tally.received < expected and time.monotonic() < deadline:
            time.sleep(1.0)
            with tally.lock:
                written, received = len(tally.committed_at), tally.received
            clock = time.monotonic() - started
            print(f"  {clock:5.1f} s  committed {written:5d}  consumed {received:5d}/{expected}")
        # What a probe of the running relay sees once the work is done.
        probes = {path: _http_status(server.url(path)) for path in ("/healthz", "/readyz")}
    except KeyboardInterrupt:
        print("interrupted: cleaning up")
        return None
    finally:
        stop.set()
        for thread in producers:
            thread.join(timeout=5)
        consumer.join(timeout=5)
        relay.stop()
        relay_thread.join(timeout=15)
        server.close()
        engine.dispose()
    elapsed = time.monotonic() - started
    with engine.connect() as conn:
        latency_row = tuple(conn.execute(_LATENCY_SQL).one())
        status = {row[0]: row[1] for row in conn.execute(_STATUS_SQL)}
    engine.dispose()
    return _Outcome(tally, elapsed, latency_row, status, probes, metrics_url)


def run_demo(args: argparse.Namespace) -> int:
    orders = int(getattr(args, "orders", 400))
    writers = int(getattr(args, "writers", 4))
    configure_logging("text", "WARNING")
    print("outbox-kafka demo: starting embedded PostgreSQL and the embedded Kafka-protocol broker")
    with embedded_stack() as (pg, broker, _base):
        try:
            outcome = _run_orders(pg.url, broker.bootstrap, orders, writers)
        finally:
            # The relay's clients go with it; collected here, before the broker stops,
            # they leave quietly instead of reporting a lost connection.
            gc.collect()
    if outcome is None:
        return 130
    _print_summary(outcome, orders, writers)
    return 0 if outcome.tally.received == orders * len(STEPS) and _in_order(outcome) else 1


def _in_order(outcome: _Outcome) -> bool:
    return outcome.tally.order_violations == 0


def _print_summary(outcome: _Outcome, orders: int, writers: int) -> None:
    tally, expected = outcome.tally, orders * len(STEPS)
    ok = tally.received == expected and _in_order(outcome)
    lat = tally.latencies
    print()
    print("outbox-kafka demo summary")
    print(f"  orders                {orders} ({writers} writers, {len(STEPS)} events each)")
    print(f"  events consumed       {tally.received}/{expected} (duplicates {tally.duplicates})")
    print(f"  outbox rows           {outcome.status}")
    throughput = tally.received / outcome.elapsed
    print(f"  throughput            {throughput:.0f} events/s over {outcome.elapsed:.1f} s")
    row = outcome.latency_row
    (p50, p90, p99), worst = row[0] or (float("nan"),) * 3, row[1] or float("nan")
    print(
        "  write->ack (relay)    "
        f"p50 {p50 * 1000:.1f} ms  p90 {p90 * 1000:.1f} ms  p99 {p99 * 1000:.1f} ms  "
        f"max {float(worst) * 1000:.1f} ms"
    )
    print(
        "  commit->consume       "
        f"p50 {_percentile(lat, 0.5) * 1000:.1f} ms  p90 {_percentile(lat, 0.9) * 1000:.1f} ms  "
        f"p99 {_percentile(lat, 0.99) * 1000:.1f} ms  "
        f"max {max(lat, default=float('nan')) * 1000:.1f} ms"
    )
    verdict = "OK" if tally.order_violations == 0 else f"{tally.order_violations} VIOLATIONS"
    print(f"  per-key order         {verdict}")
    print(f"  metrics were served   {outcome.metrics_url} (also /healthz, /readyz)")
    health = "  ".join(f"{path} {code}" for path, code in outcome.probes.items())
    print(f"  health at the end     {health}")
    print(f"  result                {'PASS' if ok else 'FAIL'}")
