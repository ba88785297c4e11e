"""The in-memory outbox of outbox_kafka.testing takes the async producer calls too."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from outbox_kafka import DuplicateEventId, Event, InvalidKey
from outbox_kafka.relay import Relay, RelaySettings
from outbox_kafka.testing import InMemoryStore, StubPublisher


def test_enqueue_async_and_enqueue_many_async_store_into_the_store() -> None:
    store, kafka = InMemoryStore(), StubPublisher()
    outbox = store.outbox(source="/orders")
    chosen = uuid.uuid4()

    async def place_orders() -> list[uuid.UUID]:
        first = await outbox.enqueue_async(
            None,  # type: ignore[arg-type]
            type="order.created",
            key="o-1",
            topic="orders",
            data={"n": 0},
            event_id=chosen,
        )
        rest = await outbox.enqueue_many_async(
            None,  # type: ignore[arg-type]
            [
                Event(type="order.paid", key="o-1", topic="orders", data={"n": 1}),
                Event(type="order.created", key="o-2", topic="orders", data={"n": 0}),
            ],
        )
        # Validation and duplicate ids as on a real outbox; nothing stored for either.
        with pytest.raises(InvalidKey):
            await outbox.enqueue_async(None, type="t", key="", topic="orders", data={})  # type: ignore[arg-type]
        with pytest.raises(DuplicateEventId):
            await outbox.enqueue_many_async(
                None,  # type: ignore[arg-type]
                [Event(type="t", key="o-3", topic="orders", data={}, event_id=chosen)],
            )
        return [first, *rest]

    ids = asyncio.run(place_orders())
    assert ids[0] == chosen
    assert [(e.key, e.seq, e.event_id) for e in store.events()] == [
        ("o-1", 1, str(ids[0])),
        ("o-1", 2, str(ids[1])),
        ("o-2", 1, str(ids[2])),
    ]
    settings = RelaySettings(database_url="postgresql://unused/db", bootstrap_servers="unused:1")
    Relay(settings, store=store, publisher=kafka).drain()
    assert [m.key for m in kafka.messages("orders")] == [b"o-1", b"o-1", b"o-2"]
