"""Binary content mode: delivered messages read back by the CloudEvents SDK and other readers."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from cloudevents.core.bindings import kafka as core_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.v1 import kafka as v1_kafka
from kafka import KafkaConsumer

from outbox_kafka import Event, InvalidHeaders, Outbox
from outbox_kafka.relay.loop import Relay
from tests.relay_support import Record, consume_all, make_settings
from tests.support import EVENT_SCHEMAS, ORDER_CREATED

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def binary_outbox() -> Outbox:
    return Outbox(
        schema_dir=EVENT_SCHEMAS,
        routes={"order.*": "orders"},
        content_mode="binary",
        source="//shop/orders",
    )


def spec_reader(headers: dict[str, bytes], value: bytes) -> dict[str, Any]:
    """The Kafka binding's rule: structured if content-type is a CloudEvents format, else binary."""
    content_type = headers.get("content-type", b"").decode()
    if content_type.startswith("application/cloudevents"):
        event: dict[str, Any] = json.loads(value)
        return event
    attributes: dict[str, Any] = {
        name[3:]: raw.decode() for name, raw in headers.items() if name.startswith("ce_")
    }
    attributes["datacontenttype"] = content_type
    attributes["data"] = json.loads(value)
    return attributes


def test_binary_mode_headers_and_value(outbox: Outbox) -> None:
    encoded = binary_outbox().encode(
        Event(
            type="order.created",
            key="o-1",
            data=ORDER_CREATED,
            subject="orders/o-1",
            traceparent=TRACEPARENT,
            headers={"tenant": "acme"},
        )
    )
    assert json.loads(encoded.value) == ORDER_CREATED
    names = [name for name, _ in encoded.headers]
    assert names == [
        "content-type",
        "ce_specversion",
        "ce_id",
        "ce_source",
        "ce_type",
        "ce_time",
        "ce_subject",
        "ce_dataschema",
        "ce_partitionkey",
        "ce_traceparent",
        "traceparent",
        "tenant",
    ]
    headers = dict(encoded.headers)
    assert headers["content-type"] == b"application/json"
    assert headers["ce_id"] == str(encoded.event_id).encode()
    assert headers["ce_time"].decode() == encoded.envelope["time"]
    assert headers["ce_dataschema"].decode() == encoded.envelope["dataschema"]


def test_binary_mode_refuses_a_header_that_is_not_utf8_and_structured_keeps_it(
    outbox: Outbox,
) -> None:
    with pytest.raises(InvalidHeaders, match="'blob' is not UTF-8 text: in binary content mode"):
        binary_outbox().encode(
            Event(type="order.created", key="o-1", data=ORDER_CREATED, headers={"blob": b"\xff"})
        )
    kept = outbox.encode(
        Event(type="order.created", key="o-1", data=ORDER_CREATED, headers={"blob": b"\xff"})
    )
    assert ("blob", b"\xff") in kept.headers


def test_an_unknown_content_mode_is_refused() -> None:
    from outbox_kafka import ConfigurationError

    with pytest.raises(ConfigurationError, match="content_mode must be one of structured, binary"):
        Outbox(content_mode="mixed")  # type: ignore[arg-type]


def _kafka_python_records(bootstrap: str, topic: str, count: int) -> dict[str, Any]:
    """The same messages through kafka-python, a client that is not librdkafka: by ce_id."""
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=15_000,
    )
    found: dict[str, Any] = {}
    try:
        for message in consumer:
            headers = dict(message.headers)
            found[headers["ce_id"].decode()] = (headers, message.value, message.key)
            if len(found) >= count:
                break
    finally:
        consumer.close()
    return found


def test_binary_messages_read_back_by_every_reader(
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    topic = new_topic(partitions=2)
    outbox = binary_outbox()
    with engine.begin() as conn:
        first = outbox.enqueue(
            conn,
            type="order.created",
            key="o-1",
            data=ORDER_CREATED,
            topic=topic,
            subject="orders/o-1",
            traceparent=TRACEPARENT,
            headers={"tenant": "acme"},
        )
        second = outbox.enqueue(
            conn, type="order.created", key="o-2", data=ORDER_CREATED, topic=topic
        )
    # What every reader must give back: the attributes as stored, per event.
    with engine.connect() as conn:
        stored = {
            str(r.event_id): dict(json.loads(r.headers_text))
            for r in conn.execute(
                sa.text("SELECT event_id, CAST(headers AS text) AS headers_text FROM outbox")
            )
        }
    expected: dict[str, dict[str, Any]] = {}
    for event_id, headers in stored.items():
        attributes = {name[3:]: value for name, value in headers.items() if name[:3] == "ce_"}
        attributes["datacontenttype"] = headers["content-type"]
        expected[event_id] = attributes
    assert expected[str(first)]["subject"] == "orders/o-1"
    assert expected[str(first)]["traceparent"] == TRACEPARENT
    assert "subject" not in expected[str(second)]

    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        relay.drain()
    finally:
        relay.close()
    records: list[Record] = consume_all(kafka_bootstrap, topic, 2)
    other_client = _kafka_python_records(kafka_bootstrap, topic, 2)

    for record in records:
        want = expected[record.ce_id]
        # The independent client sees the same bytes and headers.
        headers, value, key = other_client[record.ce_id]
        assert (headers, value, key) == (record.headers, record.raw, record.key_bytes)

        message = core_kafka.KafkaMessage(
            headers=record.headers, key=record.key_bytes, value=record.raw
        )
        for read in (core_kafka.from_kafka, core_kafka.from_binary):
            event = read(message, JSONFormat())
            attributes = {
                name: value.isoformat().replace("+00:00", "Z") if name == "time" else value
                for name, value in event.get_attributes().items()
            }
            assert attributes == want, read.__name__
            assert event.get_data() == ORDER_CREATED
        v1_event = v1_kafka.from_binary(
            v1_kafka.KafkaMessage(headers=record.headers, key=record.key, value=record.raw)
        )
        assert {k: v1_event[k] for k in want} == want
        assert v1_event.data == ORDER_CREATED
        by_rule = spec_reader(record.headers, record.raw)
        assert {k: by_rule[k] for k in want} == want and by_rule["data"] == ORDER_CREATED
    assert {r.ce_id for r in records} == {str(first), str(second)}
    first_record = next(r for r in records if r.ce_id == str(first))
    assert first_record.headers["tenant"] == b"acme"
    assert first_record.headers["traceparent"] == TRACEPARENT.encode()
