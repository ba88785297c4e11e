"""faststream-outbox as a relay to Kafka, for the peers section of the bench.

Run with the peers' virtualenv (``faststream-outbox[asyncpg]`` and
``faststream[kafka]``)::

    python faststream_peer.py fill  --database-url URL --topic T --events N --keys K --size B
    python faststream_peer.py relay --database-url URL --bootstrap HOST:PORT --topic T ...

``fill`` creates the outbox table (``make_outbox_table``) and writes the events
with ``OutboxBroker.publish_batch`` in transactions of ``--fill-batch`` rows.
``relay`` is the library's documented relay: an outbox subscriber whose handler
returns the body, decorated with a FastStream Kafka publisher, run in a
``FastStream`` application until SIGTERM. The handler returns a
``KafkaResponse`` carrying the event's key, so that the Kafka record has one.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from typing import Any

from faststream import FastStream  # type: ignore[import-not-found]
from faststream_outbox import OutboxBroker, make_outbox_table  # type: ignore[import-not-found]
from shared import common_parser, workload  # type: ignore[import-not-found]
from sqlalchemy import MetaData
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine

QUEUE = "bench"
TABLE = "outbox"


def outbox_table() -> Any:
    return make_outbox_table(MetaData(), table_name=TABLE)


async def fill(args: argparse.Namespace) -> None:
    engine = create_async_engine(args.database_url)
    table = outbox_table()
    try:
        async with engine.begin() as conn:
            await conn.run_sync(table.metadata.create_all)
        broker = OutboxBroker(engine, outbox_table=table)
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        batch: list[dict[str, Any]] = []
        for body in workload(args.events, args.keys, args.size):
            batch.append(body)
            if len(batch) == args.fill_batch:
                async with sessions() as session, session.begin():
                    await broker.publish_batch(*batch, queue=QUEUE, session=session)
                batch = []
        if batch:
            async with sessions() as session, session.begin():
                await broker.publish_batch(*batch, queue=QUEUE, session=session)
        async with engine.begin() as conn:
            await conn.exec_driver_sql(f"ANALYZE {TABLE}")
    finally:
        await engine.dispose()


def kafka_broker(args: argparse.Namespace) -> tuple[Any, Any]:
    """The foreign broker and the ``KafkaResponse`` class of the chosen client."""
    options: dict[str, Any] = {
        "acks": "all",
        "enable_idempotence": args.idempotence,
        "linger_ms": args.linger_ms,
        "log_level": logging.DEBUG,
    }
    if args.client == "confluent":
        from faststream.confluent import (  # type: ignore[import-not-found]
            KafkaBroker,
            KafkaResponse,
        )

        options["config"] = {"partitioner": "murmur2_random"}
    else:
        from faststream.kafka import (  # type: ignore[import-not-found]
            KafkaBroker,
            KafkaResponse,
        )
    return KafkaBroker(args.bootstrap, **options), KafkaResponse


async def relay(args: argparse.Namespace) -> None:
    # One fetch connection, one writer per worker, and room for the LISTEN probe.
    engine = create_async_engine(args.database_url, pool_size=args.workers + 2, max_overflow=2)
    table = outbox_table()
    # Per-message log lines go out at DEBUG, under the loggers' INFO: off, errors still shown.
    outbox = OutboxBroker(engine, outbox_table=table, log_level=logging.DEBUG)
    kafka, response = kafka_broker(args)
    publisher = kafka.publisher(args.topic)

    async def forward(body: dict[str, Any]) -> Any:
        return response(body, key=str(body["bench_key"]).encode())

    # The documented relay: @publisher stacked on @outbox.subscriber(...).
    subscriber = outbox.subscriber(
        QUEUE,
        max_workers=args.workers,
        fetch_batch_size=args.fetch_batch,
        min_fetch_interval=args.min_fetch_interval,
        max_fetch_interval=args.max_fetch_interval,
        lease_ttl_seconds=args.lease_seconds,
        terminal_flush_batch_size=args.flush_batch,
    )
    publisher(subscriber(forward))

    async def close_kafka() -> None:
        await kafka.stop()

    app = FastStream(outbox, on_startup=[kafka.connect], on_shutdown=[close_kafka])
    try:
        await app.run(log_level=logging.WARNING)
    finally:
        await engine.dispose()


def parser() -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = common_parser(__doc__)
    p.add_argument("--client", choices=("aiokafka", "confluent"), default="aiokafka")
    p.add_argument("--workers", type=int, default=16)
    p.add_argument("--fetch-batch", type=int, default=1000)
    p.add_argument("--flush-batch", type=int, default=100)
    p.add_argument("--min-fetch-interval", type=float, default=0.05)
    p.add_argument("--max-fetch-interval", type=float, default=0.5)
    p.add_argument("--lease-seconds", type=float, default=120.0)
    p.add_argument("--linger-ms", type=int, default=5)
    return p


def main() -> int:
    args = parser().parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    asyncio.run(fill(args) if args.command == "fill" else relay(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
