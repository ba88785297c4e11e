"""Outbox's writer: the seam through which its encoded events reach storage."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from outbox_kafka import ConfigurationError, Outbox
from outbox_kafka.naming import TableNames
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.producer.writing import OutboxWriter


class KeptWriter(OutboxWriter):
    """Keeps what it is given instead of writing it."""

    def __init__(self, names: TableNames) -> None:
        super().__init__(names, notify=False)
        self.kept: list[EncodedEvent] = []

    def write(self, conn: Any, encoded: list[EncodedEvent], chosen_ids: bool) -> list[uuid.UUID]:
        self.kept.extend(encoded)
        return [e.event_id for e in encoded]


def test_an_outbox_writes_its_encoded_events_through_the_writer_it_is_given() -> None:
    writer = KeptWriter(TableNames(table="orders_outbox", schema="shop"))
    outbox = Outbox(
        table="orders_outbox", db_schema="shop", allow_unknown_types=True, writer=writer
    )
    event_id = outbox.enqueue(None, type="order.created", key="o-1", data={}, topic="orders")
    assert outbox.writer is writer
    assert [(e.event_id, e.key, e.topic) for e in writer.kept] == [(event_id, "o-1", "orders")]


def test_a_writer_for_other_tables_is_refused_naming_both() -> None:
    writer = KeptWriter(TableNames(table="other"))
    with pytest.raises(ConfigurationError, match=r"public\.other.*public\.outbox"):
        Outbox(writer=writer)


def test_without_a_writer_an_outbox_writes_to_its_own_tables() -> None:
    outbox = Outbox(table="orders_outbox", db_schema="shop")
    assert outbox.writer.names == TableNames(table="orders_outbox", schema="shop")
