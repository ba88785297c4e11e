"""Enqueue from FastAPI: an order and its event in one async transaction.

Against a database the outbox is migrated in (``outbox-kafka migrate --database-url
"$DATABASE_URL"``)::

    DATABASE_URL=postgresql://postgres@127.0.0.1:5432/test \\
        uvicorn examples.fastapi_app:app

``DATABASE_URL`` may name any driver (``postgresql://``, ``postgresql+psycopg://``):
the app connects with asyncpg. At startup it creates a ``fastapi_orders`` table.

- ``POST /orders`` with ``{"id": "o-1", "customer_id": "c-1", "total_cents": 1250}``
  writes the order row and its ``order.created`` event in one transaction: 201.
- ``POST /orders/fail-after-enqueue`` with the same body writes both, then fails before
  the transaction commits: 500, and neither the order nor the event exists.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Annotated

import sqlalchemy as sa
from fastapi import Depends, FastAPI, Request
from pydantic import BaseModel
from sqlalchemy.engine import make_url
from sqlalchemy.ext.asyncio import AsyncSession, async_sessionmaker, create_async_engine

import outbox_kafka
from outbox_kafka import Outbox

metadata = sa.MetaData()

orders = sa.Table(
    "fastapi_orders",
    metadata,
    sa.Column("id", sa.Text, primary_key=True),
    sa.Column("customer_id", sa.Text, nullable=False),
    sa.Column("total_cents", sa.BigInteger, nullable=False),
)


def asyncpg_url(url: str) -> sa.URL:
    """``url`` with asyncpg as its driver."""
    return make_url(url.replace("postgres://", "postgresql://", 1)).set(
        drivername="postgresql+asyncpg"
    )


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    engine = create_async_engine(asyncpg_url(os.environ["DATABASE_URL"]))
    async with engine.begin() as conn:
        await conn.run_sync(metadata.create_all)
    outbox_kafka.configure(Outbox(source="//shop/orders-service", routes={"order.*": "orders"}))
    app.state.sessions = async_sessionmaker(engine, expire_on_commit=False)
    yield
    await engine.dispose()


app = FastAPI(lifespan=lifespan)


async def get_session(request: Request) -> AsyncIterator[AsyncSession]:
    async with request.app.state.sessions() as session:  # closed when the request is done
        yield session


SessionDep = Annotated[AsyncSession, Depends(get_session)]


class OrderIn(BaseModel):
    id: str
    customer_id: str
    total_cents: int


class PaymentServiceDown(RuntimeError):
    """What the failing route raises after its enqueue."""


async def write_order(session: AsyncSession, order: OrderIn) -> str:
    """The order row and its event, in the session's transaction; the event's id."""
    await session.execute(orders.insert().values(**order.model_dump()))
    event_id = await outbox_kafka.enqueue_async(
        session,
        type="order.created",
        key=order.id,
        data={"order_id": order.id, "customer_id": order.customer_id, "total": order.total_cents},
    )
    return str(event_id)


@app.post("/orders", status_code=201)
async def create_order(order: OrderIn, session: SessionDep) -> dict[str, str]:
    async with session.begin():  # the transaction begins here ...
        event_id = await write_order(session, order)
    # ... and committed as the block ended: the order and its event exist together.
    return {"id": order.id, "event_id": event_id}


@app.post("/orders/fail-after-enqueue", status_code=201)
async def create_order_then_fail(order: OrderIn, session: SessionDep) -> dict[str, str]:
    async with session.begin():
        await write_order(session, order)
        # The exception leaves the block: the transaction rolls back, and the order
        # and its event with it. The client gets a 500; nothing is published.
        raise PaymentServiceDown(f"payment service unavailable for order {order.id}")
