"""omni-box as an outbox publisher to Kafka, for the peers section of the bench.

Run with the peers' virtualenv (``omni-box[postgres,kafka]``)::

    python omnibox_peer.py fill  --database-url URL --topic T --events N --keys K --size B
    python omnibox_peer.py relay --database-url URL --bootstrap HOST:PORT ...

``fill`` creates the outbox table (the library's ``OutboxEventDBBase`` bound to
a ``DeclarativeBase`` of our own, as its quick start shows) and writes the
events made by ``OmniBoxDomainService.create_outbox_event`` (the event's key as
``partition_key``) with ``PostgresOutboxRepository.bulk_create``, in
transactions of ``--fill-batch`` events. ``relay`` runs ``--workers`` copies of
the documented publisher loop, each in a transaction of its own per cycle
(omni-box commits nothing itself)::

    async with sessions() as session, session.begin():
        result = await OutboxPublisher(repo, broker).publish_batch(worker_id, batch_size)
    if not result.processed_event_ids:
        await asyncio.sleep(idle)

with ``KafkaEventPublisher`` over an ``AIOKafkaProducer`` and the
``EnvelopeEventConverter``, until SIGTERM.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import uuid
from typing import Any

import structlog  # type: ignore[import-not-found]
from aiokafka import AIOKafkaProducer  # type: ignore[import-not-found]
from omni_box import OmniBoxDomainService, OutboxPublisher  # type: ignore[import-not-found]
from omni_box.core.converters import EnvelopeEventConverter  # type: ignore[import-not-found]
from omni_box.infra.brokers.kafka import KafkaEventPublisher  # type: ignore[import-not-found]
from omni_box.infra.storage.postgres import (  # type: ignore[import-not-found]
    OutboxEventDBBase,
    PostgresOutboxRepository,
)
from shared import common_parser, workload  # type: ignore[import-not-found]
from sqlalchemy.ext.asyncio import async_sessionmaker, create_async_engine
from sqlalchemy.orm import DeclarativeBase

EVENT_TYPE = "bench.peer"
AGGREGATE_TYPE = "customer"


class Base(DeclarativeBase):
    pass


class OutboxEventDB(Base, OutboxEventDBBase):  # type: ignore[misc]
    pass


def quiet_logs() -> None:
    """omni-box logs through structlog: keep warnings and errors, drop the per-batch lines."""
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)


async def fill(args: argparse.Namespace) -> None:
    engine = create_async_engine(args.database_url)
    try:
        async with engine.begin() as conn:
            await conn.run_sync(Base.metadata.create_all)
        sessions = async_sessionmaker(engine, expire_on_commit=False)
        domain = OmniBoxDomainService()
        batch: list[Any] = []

        async def write() -> None:
            async with sessions() as session, session.begin():
                repo = PostgresOutboxRepository(session, model_class=OutboxEventDB)
                await repo.bulk_create(batch)

        for data in workload(args.events, args.keys, args.size):
            key = data["bench_key"]
            batch.append(
                domain.create_outbox_event(
                    aggregate_type=AGGREGATE_TYPE,
                    aggregate_id=uuid.uuid5(uuid.NAMESPACE_URL, key),
                    event_type=EVENT_TYPE,
                    topic=args.topic,
                    partition_key=key,
                    payload=data,
                )
            )
            if len(batch) == args.fill_batch:
                await write()
                batch = []
        if batch:
            await write()
        async with engine.begin() as conn:
            await conn.exec_driver_sql(f"ANALYZE {OutboxEventDB.__tablename__}")
    finally:
        await engine.dispose()


async def relay(args: argparse.Namespace) -> None:
    engine = create_async_engine(args.database_url, pool_size=args.workers + 1)
    sessions = async_sessionmaker(engine, expire_on_commit=False)
    producer = AIOKafkaProducer(
        bootstrap_servers=args.bootstrap,
        acks="all",
        enable_idempotence=args.idempotence,
        linger_ms=args.linger_ms,
    )
    await producer.start()
    broker = KafkaEventPublisher(producer=producer, converter=EnvelopeEventConverter())
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)

    async def worker(n: int) -> None:
        worker_id = f"bench-publisher-{n}"
        while not stop.is_set():
            async with sessions() as session, session.begin():
                repo = PostgresOutboxRepository(session, model_class=OutboxEventDB)
                result = await OutboxPublisher(repo, broker).publish_batch(
                    worker_id=worker_id,
                    batch_size=args.batch_size,
                    shutdown_requested_func=stop.is_set,
                )
            if not result.processed_event_ids:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stop.wait(), timeout=args.idle_seconds)

    try:
        await asyncio.gather(*(worker(n) for n in range(args.workers)))
    finally:
        await producer.stop()
        await engine.dispose()


def parser() -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = common_parser(__doc__)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--batch-size", type=int, default=50)
    p.add_argument("--idle-seconds", type=float, default=0.05)
    p.add_argument("--linger-ms", type=int, default=0)
    return p


def main() -> int:
    args = parser().parse_args()
    quiet_logs()
    asyncio.run(fill(args) if args.command == "fill" else relay(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
