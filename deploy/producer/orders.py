"""The compose stack's orders service: writes orders and their outbox events, forever.

A stand-in for an application using the producer API: each step of an order
(created, paid, shipped) is one transaction that changes the ``demo_orders``
row and enqueues the matching event, so the relay always has work and the
dashboards move. Run with ``--orders N`` to stop after N orders.

    python deploy/producer/orders.py --rate 50        # events per second
"""

from __future__ import annotations

import argparse
import logging
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy.exc import DBAPIError

from outbox_kafka import Outbox, OutboxError
from outbox_kafka.database import make_engine, redact_url
from outbox_kafka.validation import shipped_schema_dir

STEPS = ("order.created", "order.paid", "order.shipped")
ORDERS = sa.Table(
    "demo_orders",
    sa.MetaData(),
    sa.Column("order_id", sa.Text, primary_key=True),
    sa.Column("status", sa.Text, nullable=False),
    sa.Column("total_cents", sa.Integer, nullable=False),
)
log = logging.getLogger("orders")


def _data(step: str, order_id: str, rng: random.Random) -> dict[str, object]:
    """A payload that satisfies the shipped schema of ``step``."""
    if step == "order.created":
        lines = [
            (rng.randint(1, 40), rng.randint(1, 4), rng.randint(100, 9_900))
            for _ in range(rng.randint(1, 3))
        ]
        items = [
            {"sku": f"sku-{sku:03d}", "quantity": quantity, "unit_price_cents": price}
            for sku, quantity, price in lines
        ]
        total = sum(quantity * price for _sku, quantity, price in lines)
        return {
            "order_id": order_id,
            "customer_id": f"customer-{rng.randint(1, 500)}",
            "items": items,
            "total_cents": total,
            "currency": "EUR",
        }
    if step == "order.paid":
        return {
            "order_id": order_id,
            "payment_id": f"pay-{rng.getrandbits(48):012x}",
            "amount_cents": rng.randint(100, 50_000),
            "currency": "EUR",
        }
    return {
        "order_id": order_id,
        "carrier": rng.choice(("DHL", "UPS", "PostNL")),
        "tracking_number": f"TR{rng.getrandbits(40):010X}",
    }


def _write_step(
    engine: sa.Engine, outbox: Outbox, order_id: str, step: str, rng: random.Random
) -> None:
    """One business transaction: the order row and its event commit together."""
    data = _data(step, order_id, rng)
    with engine.begin() as conn:
        if step == "order.created":
            conn.execute(
                ORDERS.insert().values(
                    order_id=order_id, status="created", total_cents=data["total_cents"]
                )
            )
        else:
            conn.execute(
                ORDERS.update()
                .where(ORDERS.c.order_id == order_id)
                .values(status=step.removeprefix("order."))
            )
        outbox.enqueue(conn, type=step, key=order_id, data=data)


def run(args: argparse.Namespace, stop: threading.Event) -> int:
    engine = make_engine(args.database_url)
    outbox = Outbox(
        schema_dir=args.schema_dir,
        routes={"order.*": args.topic},
        source="//outbox-kafka/demo-orders",
    )
    ORDERS.metadata.create_all(engine, checkfirst=True)
    rng = random.Random(args.seed)
    run_id = f"{rng.getrandbits(32):08x}"
    open_orders: dict[str, int] = {}
    created = finished = events = 0
    interval = 1.0 / args.rate
    next_at = last_report = time.monotonic()
    log.info("writing orders to %s at %.1f events/s", redact_url(args.database_url), args.rate)
    try:
        while not stop.is_set():
            may_create = args.orders == 0 or created < args.orders
            if not open_orders and not may_create:
                break
            # Keep a few dozen orders in flight, so keys interleave as in a real service.
            if may_create and (len(open_orders) < 30 or rng.random() < 0.2):
                order_id = f"order-{run_id}-{created:07d}"
                created += 1
                open_orders[order_id] = 0
            else:
                order_id = rng.choice(list(open_orders))
            step = STEPS[open_orders[order_id]]
            try:
                _write_step(engine, outbox, order_id, step, rng)
            except DBAPIError as exc:
                log.warning("database error, retrying in 2 s: %s", exc.orig)
                stop.wait(2.0)
                continue
            events += 1
            open_orders[order_id] += 1
            if open_orders[order_id] == len(STEPS):
                del open_orders[order_id]
                finished += 1
            now = time.monotonic()
            if now - last_report >= 10.0:
                log.info("%d events written, %d orders complete", events, finished)
                last_report = now
            next_at = max(next_at + interval, now - 1.0)
            stop.wait(max(0.0, next_at - now))
    finally:
        engine.dispose()
    log.info("stopped: %d events written, %d orders complete", events, finished)
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--database-url",
        default=os.environ.get("OUTBOX_DATABASE_URL"),
        help="PostgreSQL URL [env OUTBOX_DATABASE_URL]",
    )
    parser.add_argument(
        "--rate",
        type=float,
        default=float(os.environ.get("DEMO_EVENTS_PER_SECOND", "20")),
        help="events per second (default 20) [env DEMO_EVENTS_PER_SECOND]",
    )
    parser.add_argument("--orders", type=int, default=0, help="stop after N orders (0: never)")
    parser.add_argument("--topic", default=os.environ.get("DEMO_TOPIC", "orders"))
    parser.add_argument("--seed", type=int, default=None, help="random seed")
    parser.add_argument(
        "--schema-dir",
        type=Path,
        default=shipped_schema_dir() / "events",
        help="payload schemas (default: the ones shipped with outbox-kafka)",
    )
    args = parser.parse_args(argv)
    if not args.database_url:
        parser.error("no database URL (--database-url or OUTBOX_DATABASE_URL)")
    if args.rate <= 0:
        parser.error(f"--rate must be positive, got {args.rate}")
    if args.orders < 0:
        parser.error(f"--orders must not be negative, got {args.orders}")
    return args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    args = parse_args(argv)
    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    try:
        return run(args, stop)
    except OutboxError as exc:
        print(f"orders: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
