"""Outbox.encode(): the CloudEvents envelope, the Kafka headers and event ids (no database)."""

from __future__ import annotations

import itertools
import json
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest

from outbox_kafka import Event, Outbox
from outbox_kafka.errors import ConfigurationError, InvalidHeaders
from outbox_kafka.producer.ids import uuid7
from outbox_kafka.stored_headers import headers_from_json, headers_to_json
from tests.support import EVENT_SCHEMAS, GOOD_TRACEPARENT, ORDER_CREATED, ORDER_PAID

ORDER_CREATED_ID = json.loads((EVENT_SCHEMAS / "order.created.json").read_text())["$id"]


def envelope_of(value: bytes) -> dict[str, Any]:
    decoded = json.loads(value.decode("utf-8"))
    assert isinstance(decoded, dict)
    return decoded


def test_envelope_required_attributes(outbox: Outbox) -> None:
    before = datetime.now(UTC)
    encoded = outbox.encode(Event(type="order.created", key="order-7", data=ORDER_CREATED))
    after = datetime.now(UTC)
    envelope = envelope_of(encoded.value)

    assert envelope["specversion"] == "1.0"
    assert envelope["id"] == str(encoded.event_id)
    assert envelope["source"] == "outbox-kafka"
    assert envelope["type"] == "order.created"
    assert envelope["datacontenttype"] == "application/json"
    assert envelope["partitionkey"] == "order-7"
    assert envelope["data"] == ORDER_CREATED
    for absent in ("subject", "traceparent"):
        assert absent not in envelope

    stamp = envelope["time"]
    assert isinstance(stamp, str)
    assert stamp.endswith("Z")
    parsed = datetime.fromisoformat(stamp[:-1] + "+00:00")
    assert before - timedelta(milliseconds=1) <= parsed <= after + timedelta(milliseconds=1)


def test_encoded_event_fields(outbox: Outbox) -> None:
    when = datetime(2031, 5, 6, 7, 8, 9, tzinfo=UTC)
    encoded = outbox.encode(
        Event(type="order.paid", key="order-9", data=ORDER_PAID, available_at=when)
    )
    assert encoded.key == "order-9"
    assert encoded.type == "order.paid"
    assert encoded.topic == "orders"
    assert encoded.available_at == when
    assert isinstance(encoded.event_id, uuid.UUID)
    # The envelope dict is what the value holds, minus the spliced-in data.
    envelope = envelope_of(encoded.value)
    assert envelope.pop("data") == ORDER_PAID
    assert envelope == encoded.envelope


def test_optional_attributes_when_given(outbox: Outbox) -> None:
    event_id = uuid.uuid4()
    encoded = outbox.encode(
        Event(
            type="order.created",
            key="order-1",
            data=ORDER_CREATED,
            event_id=event_id,
            source="/shop/checkout",
            subject="order/1",
            traceparent=GOOD_TRACEPARENT,
        )
    )
    envelope = envelope_of(encoded.value)
    assert encoded.event_id == event_id
    assert envelope["id"] == str(event_id)
    assert envelope["source"] == "/shop/checkout"
    assert envelope["subject"] == "order/1"
    assert envelope["traceparent"] == GOOD_TRACEPARENT


def test_dataschema_is_the_payload_schema_id(outbox: Outbox) -> None:
    encoded = outbox.encode(Event(type="order.created", key="k", data=ORDER_CREATED))
    assert ORDER_CREATED_ID.endswith("order.created.json")
    assert envelope_of(encoded.value)["dataschema"] == ORDER_CREATED_ID


def test_no_dataschema_without_schema() -> None:
    plain = Outbox(routes={"*": "events"})
    encoded = plain.encode(Event(type="order.created", key="k", data=ORDER_CREATED))
    assert "dataschema" not in envelope_of(encoded.value)


def test_outbox_default_source() -> None:
    custom = Outbox(routes={"*": "events"}, source="urn:shop:billing")
    encoded = custom.encode(Event(type="a", key="k", data=1))
    assert envelope_of(encoded.value)["source"] == "urn:shop:billing"
    overridden = custom.encode(Event(type="a", key="k", data=1, source="urn:other"))
    assert envelope_of(overridden.value)["source"] == "urn:other"


def test_headers_order_without_traceparent(outbox: Outbox) -> None:
    encoded = outbox.encode(
        Event(
            type="order.created",
            key="k",
            data=ORDER_CREATED,
            headers=[("x-b", "2"), ("x-a", b"\x00\x01"), ("x-b", "again")],
        )
    )
    assert encoded.headers == [
        ("content-type", b"application/cloudevents+json"),
        ("x-b", b"2"),
        ("x-a", b"\x00\x01"),
        ("x-b", b"again"),
    ]


def test_headers_order_with_traceparent_and_mapping(outbox: Outbox) -> None:
    encoded = outbox.encode(
        Event(
            type="order.created",
            key="k",
            data=ORDER_CREATED,
            source="src",
            traceparent=GOOD_TRACEPARENT,
            headers={"z-last": "1", "a-first": "ünï"},
        )
    )
    assert [name for name, _ in encoded.headers] == [
        "content-type",
        "traceparent",
        "z-last",
        "a-first",
    ]
    headers = dict(encoded.headers)
    assert headers["traceparent"] == GOOD_TRACEPARENT.encode()
    assert headers["a-first"] == "ünï".encode()


def test_no_header_names_a_cloudevents_attribute_in_structured_mode(outbox: Outbox) -> None:
    """A reader that finds a ``ce_`` header takes the message for binary mode."""
    encoded = outbox.encode(
        Event(type="order.created", key="k", data=ORDER_CREATED, traceparent=GOOD_TRACEPARENT)
    )
    assert not [name for name, _ in encoded.headers if name.startswith("ce_")]


@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_the_id_header_carries_the_event_id_after_the_library_headers(mode: str) -> None:
    box = Outbox(routes={"*": "events"}, id_header="id", content_mode=mode)  # type: ignore[arg-type]
    encoded = box.encode(
        Event(
            type="order.created",
            key="k",
            data=ORDER_CREATED,
            traceparent=GOOD_TRACEPARENT,
            headers={"x-own": "1"},
        )
    )
    names = [name for name, _ in encoded.headers]
    assert dict(encoded.headers)["id"] == str(encoded.event_id).encode()
    assert names.count("id") == 1
    assert names[-1] == "x-own"
    if mode == "structured":
        assert names == ["content-type", "id", "traceparent", "x-own"]
    assert encoded.stored_headers == headers_to_json(encoded.headers)


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("ce_id", "starts with 'ce_'"),
        ("CE_Dedup", "starts with 'ce_'"),
        ("content-type", "sets itself"),
        ("traceparent", "sets itself"),
        ("", "non-empty str"),
        (7, "non-empty str"),
        ("a\x00b", "control character"),
        (" id", "space"),
        ("id\n", "control character"),
        ("id\ud800", "not printable"),
    ],
)
def test_an_id_header_the_binding_or_the_library_owns_is_refused(
    name: object, problem: str
) -> None:
    with pytest.raises(ConfigurationError, match=problem):
        Outbox(routes={"*": "events"}, id_header=name)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("id", "is the outbox's id_header"),
        ("ID", "is the outbox's id_header"),
        ("ce_custom", "are CloudEvents attributes"),
        ("Ce_Type", "is set by outbox-kafka itself"),
    ],
)
def test_own_headers_named_as_the_id_header_or_an_attribute_are_refused(
    name: str, problem: str
) -> None:
    box = Outbox(routes={"*": "events"}, id_header="id")
    with pytest.raises(InvalidHeaders, match=problem):
        box.encode(Event(type="a", key="k", data=1, headers={name: "x"}))


@pytest.mark.parametrize(
    "data",
    [
        None,
        0,
        -1.5,
        True,
        "text",
        [],
        {},
        {"nested": {"list": [1, 2.5, None, False, "x"]}, "unicode": "zürich ☃ 𝄞", "q": '"\\'},
        {"control": "\x00\x1f\n", "big": 2**70},
    ],
    ids=repr,
)
def test_value_round_trips_data(data: Any) -> None:
    plain = Outbox(routes={"*": "events"})
    encoded = plain.encode(Event(type="anything", key="k", data=data))
    envelope = envelope_of(encoded.value)
    assert envelope["data"] == data
    assert type(envelope["data"]) is type(data)


def test_value_is_utf8_json_without_ascii_escapes() -> None:
    plain = Outbox(routes={"*": "events"})
    encoded = plain.encode(Event(type="t", key="clé", data={"city": "Zürich"}))
    assert "Zürich".encode() in encoded.value
    assert "clé".encode() in encoded.value


def test_every_event_gets_a_new_id(outbox: Outbox) -> None:
    event = Event(type="order.created", key="k", data=ORDER_CREATED)
    first, second = outbox.encode(event), outbox.encode(event)
    assert first.event_id != second.event_id
    assert first.event_id.version == 7


# --- uuid7 --------------------------------------------------------------------------------


def test_uuid7_version_variant_and_time() -> None:
    now_ms = datetime.now(UTC).timestamp() * 1000
    value = uuid7()
    assert value.version == 7
    assert value.variant == uuid.RFC_4122
    assert abs((value.int >> 80) - now_ms) < 5_000


def test_uuid7_strictly_increasing() -> None:
    ids = [uuid7() for _ in range(10_000)]
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in ids)
    assert all(a.int < b.int for a, b in itertools.pairwise(ids))
    # Lexicographic order of the text form is the same order (what the database sorts by).
    texts = [str(u) for u in ids]
    assert texts == sorted(texts)
    assert len(set(texts)) == len(texts)


def test_uuid7_increasing_when_clock_is_stuck_or_goes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    generator = type(uuid7)()
    frozen = 1_700_000_000_000 * 1_000_000
    clock = {"now": frozen}
    monkeypatch.setattr(time, "time_ns", lambda: clock["now"])
    # Far more ids than the 12-bit counter holds in one millisecond.
    ids = [generator() for _ in range(10_000)]
    clock["now"] = frozen - 10_000 * 1_000_000  # ten seconds back
    ids += [generator() for _ in range(100)]
    assert all(a.int < b.int for a, b in itertools.pairwise(ids))
    assert all(u.version == 7 and u.variant == uuid.RFC_4122 for u in ids)
    # The timestamp field only ever moves forward, starting at the frozen time.
    assert ids[0].int >> 80 == frozen // 1_000_000


def test_uuid7_increasing_within_each_thread_and_unique_across_threads() -> None:
    results: dict[int, list[uuid.UUID]] = {}

    def run(n: int) -> None:
        results[n] = [uuid7() for _ in range(5_000)]

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for ids in results.values():
        assert all(a.int < b.int for a, b in itertools.pairwise(ids))
    everything = [u for ids in results.values() for u in ids]
    assert len(set(everything)) == 20_000


def test_available_at_keeps_its_offset(outbox: Outbox) -> None:
    when = datetime(2030, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=5, minutes=30)))
    encoded = outbox.encode(
        Event(type="order.created", key="k", data=ORDER_CREATED, available_at=when)
    )
    assert encoded.available_at == when
    assert encoded.available_at is not None
    assert encoded.available_at.utcoffset() == timedelta(hours=5, minutes=30)


@pytest.mark.parametrize(
    "headers",
    [
        [],
        [("a", b"text"), ("a", b"again")],
        [("bin", b"\xff\xfe"), ("nul", b"x\x00y"), ("utf8", "é".encode())],
    ],
)
def test_stored_headers_round_trip_byte_for_byte(headers: list[tuple[str, bytes]]) -> None:
    stored = json.loads(headers_to_json(headers))
    assert headers_from_json(stored) == headers
    # jsonb cannot hold NUL: such values must not be stored as text.
    assert "\x00" not in json.dumps(stored, ensure_ascii=False).replace("\\u0000", "")
    assert all(isinstance(v, (str, dict)) for _, v in stored)


@pytest.mark.parametrize(
    "stored",
    [None, {}, [["a"]], [[1, "x"]], [["a", 5]], [["a", {"base64": "***"}]], [["a", {"hex": "00"}]]],
)
def test_malformed_stored_headers_are_reported(stored: object) -> None:
    assert headers_from_json(stored) is None
