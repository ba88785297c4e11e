"""The CloudEvents content modes: delivered messages read back by the CloudEvents SDK (core and
v1 APIs), a reader following the Kafka binding's content-type rule, and kafka-python; the
producer's extension attributes read back by the SDK in both modes."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import Any

import pytest
import sqlalchemy as sa
from cloudevents.core.bindings import kafka as core_kafka
from cloudevents.core.formats.json import JSONFormat
from cloudevents.v1 import kafka as v1_kafka
from kafka import KafkaConsumer

from outbox_kafka import Event, InvalidAttribute, InvalidHeaders, Outbox
from outbox_kafka.relay.loop import Relay
from tests.relay_support import Record, consume_all, make_settings
from tests.support import EVENT_SCHEMAS, ORDER_CREATED

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
ORDER_CREATED_SCHEMA = json.loads((EVENT_SCHEMAS / "order.created.json").read_text())["$id"]


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


def _kafka_python_records(
    bootstrap: str, topic: str, count: int
) -> dict[tuple[int, int], tuple[dict[str, bytes], bytes, bytes]]:
    """The same messages through kafka-python, a client that is not librdkafka:
    headers, value and key by (partition, offset)."""
    consumer = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        consumer_timeout_ms=15_000,
    )
    found: dict[tuple[int, int], tuple[dict[str, bytes], bytes, bytes]] = {}
    try:
        for message in consumer:
            found[(message.partition, message.offset)] = (
                dict(message.headers),
                message.value,
                message.key,
            )
            if len(found) >= count:
                break
    finally:
        consumer.close()
    return found


def _core_attributes(event: Any) -> dict[str, Any]:
    """A core SDK event's attributes, its time in the RFC 3339 form it was sent in."""
    return {
        name: value.isoformat().replace("+00:00", "Z") if name == "time" else value
        for name, value in event.get_attributes().items()
    }


MODES = {
    "structured": Outbox(
        schema_dir=EVENT_SCHEMAS, routes={"order.*": "orders"}, source="//shop/orders"
    ),
    "structured, id header": Outbox(
        schema_dir=EVENT_SCHEMAS,
        routes={"order.*": "orders"},
        source="//shop/orders",
        id_header="id",
    ),
    "binary": binary_outbox(),
    "binary, id header": Outbox(
        schema_dir=EVENT_SCHEMAS,
        routes={"order.*": "orders"},
        source="//shop/orders",
        content_mode="binary",
        id_header="id",
    ),
}


@pytest.mark.parametrize("mode", list(MODES))
def test_delivered_messages_read_back_by_every_reader(
    mode: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    """id, type, source, subject, time, datacontenttype, dataschema, the extensions
    (partitionkey, traceparent) and data come back as sent, whichever reader reads them."""
    topic = new_topic(partitions=2)
    outbox = MODES[mode]
    structured = mode.startswith("structured")
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
    with engine.connect() as conn:
        times = {
            str(r.event_id): json.loads(bytes(r.value))["time"] if structured else None
            for r in conn.execute(sa.text("SELECT event_id, value FROM outbox"))
        }
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        relay.drain()
    finally:
        relay.close()
    records: list[Record] = consume_all(kafka_bootstrap, topic, 2)
    other_client = _kafka_python_records(kafka_bootstrap, topic, 2)
    assert {r.event_id for r in records} == {str(first), str(second)}

    for record in records:
        sent: dict[str, Any] = {
            "specversion": "1.0",
            "id": record.event_id,
            "source": "//shop/orders",
            "type": "order.created",
            "time": times[record.event_id] or record.headers["ce_time"].decode(),
            "datacontenttype": "application/json",
            "dataschema": ORDER_CREATED_SCHEMA,
            "partitionkey": record.key,
        }
        if record.event_id == str(first):
            sent |= {"subject": "orders/o-1", "traceparent": TRACEPARENT}
        # The independent client sees the same bytes and headers.
        assert other_client[(record.partition, record.offset)] == (
            record.headers,
            record.raw,
            record.key_bytes,
        )
        assert not structured or not [n for n in record.headers if n.startswith("ce_")]
        if outbox.id_header is not None:
            assert record.headers[outbox.id_header] == record.event_id.encode()

        message = core_kafka.KafkaMessage(
            headers=record.headers, key=record.key_bytes, value=record.raw
        )
        own_mode = core_kafka.from_structured if structured else core_kafka.from_binary
        for read in (core_kafka.from_kafka, own_mode):
            event = read(message, JSONFormat())
            assert _core_attributes(event) == sent, read.__name__
            assert event.get_data() == ORDER_CREATED, read.__name__

        by_rule = spec_reader(record.headers, record.raw)
        assert {k: by_rule[k] for k in sent} == sent and by_rule["data"] == ORDER_CREATED

        # The v1 readers make the key they are given the partitionkey: given decoded, as
        # the message reference says (confluent-kafka's msg.key() is bytes).
        v1_message = v1_kafka.KafkaMessage(headers=record.headers, key=record.key, value=record.raw)
        if structured:
            v1_event = v1_kafka.from_structured(v1_message)
            # The v1 reader takes datacontenttype from the content-type header (the
            # CloudEvents format's, by the binding): everything else is as sent. With
            # the headers left out it reads the envelope alone, datacontenttype too.
            assert v1_event["datacontenttype"] == "application/cloudevents+json"
            assert {k: v1_event[k] for k in sent if k != "datacontenttype"} == {
                k: v for k, v in sent.items() if k != "datacontenttype"
            }
            envelope_only = v1_kafka.from_structured(
                v1_kafka.KafkaMessage(headers={}, key=record.key, value=record.raw)
            )
            assert envelope_only.get_attributes() == sent
            assert envelope_only.data == ORDER_CREATED
        else:
            v1_event = v1_kafka.from_binary(v1_message)
            assert {k: v1_event[k] for k in sent} == sent
        assert v1_event.data == ORDER_CREATED

    first_record = next(r for r in records if r.event_id == str(first))
    assert first_record.headers["tenant"] == b"acme"
    assert first_record.headers["traceparent"] == TRACEPARENT.encode()


def test_structured_mode_headers(outbox: Outbox) -> None:
    """Nothing but content-type and what the event asks for: no ce_ header."""
    plain = outbox.encode(Event(type="order.created", key="o-1", data=ORDER_CREATED))
    assert plain.headers == [("content-type", b"application/cloudevents+json")]
    full = MODES["structured, id header"].encode(
        Event(
            type="order.created",
            key="o-1",
            data=ORDER_CREATED,
            traceparent=TRACEPARENT,
            headers={"tenant": "acme"},
        )
    )
    assert full.headers == [
        ("content-type", b"application/cloudevents+json"),
        ("id", str(full.event_id).encode()),
        ("traceparent", TRACEPARENT.encode()),
        ("tenant", b"acme"),
    ]


#: One extension attribute of each CloudEvents type, as enqueued.
EXTENSIONS: dict[str, Any] = {
    "tenant": "acme",
    "homepage": "https://shop.example/orders?id=o-1",
    "retries": 3,
    "urgent": True,
    "signature": b"\x00\xff\x10",
    "due": datetime(2026, 3, 4, 5, 6, 7, tzinfo=timezone(timedelta(hours=2))),
}
#: As every reader of the structured mode gets them: Boolean and Integer as JSON's own.
EXTENSIONS_STRUCTURED: dict[str, Any] = {
    "tenant": "acme",
    "homepage": "https://shop.example/orders?id=o-1",
    "retries": 3,
    "urgent": True,
    "signature": "AP8Q",
    "due": "2026-03-04T03:06:07.000000Z",
}
#: As every reader of the binary mode gets them: the canonical string encoding of each.
EXTENSIONS_BINARY = EXTENSIONS_STRUCTURED | {"retries": "3", "urgent": "true"}


@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_extension_attributes_are_read_back_by_the_sdk(
    mode: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    """Extensions enqueued (one call, and a batch) go through the relay and the broker and
    come back from the SDK's Kafka readers, beside the library's own extensions."""
    topic = new_topic(partitions=1)
    outbox = MODES[mode]
    structured = mode == "structured"
    with engine.begin() as conn:
        first = outbox.enqueue(
            conn,
            type="order.created",
            key="o-1",
            data=ORDER_CREATED,
            topic=topic,
            traceparent=TRACEPARENT,
            extensions=EXTENSIONS,
        )
        second = outbox.enqueue_many(
            conn,
            [
                Event(
                    type="order.created",
                    key="o-1",
                    data=ORDER_CREATED,
                    topic=topic,
                    extensions={"tenant": "globex", "retries": -(2**31)},
                )
            ],
        )[0]
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        relay.drain()
    finally:
        relay.close()
    records = {r.event_id: r for r in consume_all(kafka_bootstrap, topic, 2)}
    assert set(records) == {str(first), str(second)}

    expected = {
        str(first): (EXTENSIONS_STRUCTURED if structured else EXTENSIONS_BINARY)
        | {"traceparent": TRACEPARENT, "partitionkey": "o-1"},
        str(second): {"tenant": "globex", "partitionkey": "o-1"}
        | ({"retries": -2147483648} if structured else {"retries": "-2147483648"}),
    }
    for event_id, record in records.items():
        wanted = expected[event_id]
        names = set(wanted)
        message = core_kafka.KafkaMessage(
            headers=record.headers, key=record.key_bytes, value=record.raw
        )
        own_mode = core_kafka.from_structured if structured else core_kafka.from_binary
        for read in (core_kafka.from_kafka, own_mode):
            event = read(message, JSONFormat())
            assert {n: event.get_extension(n) for n in names} == wanted, read.__name__
            assert event.get_data() == ORDER_CREATED
        if structured:
            # No ce_ header: the extensions are members of the envelope alone.
            assert not [n for n in record.headers if n.startswith("ce_")]
            v1_event = v1_kafka.from_structured(
                v1_kafka.KafkaMessage(headers={}, key=record.key, value=record.raw)
            )
        else:
            assert {n: record.headers[f"ce_{n}"].decode() for n in names} == wanted
            v1_event = v1_kafka.from_binary(
                v1_kafka.KafkaMessage(headers=record.headers, key=record.key, value=record.raw)
            )
        assert {n: v1_event[n] for n in names} == wanted
    # The W3C header is still the event's traceparent, not overwritten by anything.
    assert records[str(first)].headers["traceparent"] == TRACEPARENT.encode()


def test_a_bad_extension_writes_nothing_and_names_the_event(
    outbox: Outbox, engine: sa.Engine
) -> None:
    with engine.begin() as conn:
        with pytest.raises(InvalidAttribute, match=r"^event 1: extensions: 'Tenant' is not"):
            outbox.enqueue_many(
                conn,
                [
                    Event(type="order.created", key="o-1", data=ORDER_CREATED),
                    {
                        "type": "order.created",
                        "key": "o-1",
                        "data": ORDER_CREATED,
                        "extensions": {"Tenant": "acme"},
                    },
                ],
            )
        with pytest.raises(InvalidAttribute, match="'count': 2147483648 is outside"):
            outbox.enqueue(
                conn,
                type="order.created",
                key="o-1",
                data=ORDER_CREATED,
                extensions={"count": 2**31},
            )
        # The transaction is still usable, and holds no event.
        assert conn.execute(sa.text("SELECT count(*) FROM outbox")).scalar_one() == 0
