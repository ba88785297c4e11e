"""Event(extensions=...): CloudEvents extension attributes checked, encoded in both content
modes, stored and read back by the relay's checks (no database, no broker)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, date, datetime, timedelta, timezone
from decimal import Decimal
from enum import IntEnum, StrEnum
from typing import Any

import pytest

from outbox_kafka import (
    Event,
    InvalidAttribute,
    InvalidHeaders,
    MessageTooLarge,
    Outbox,
)
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.producer.extensions import RESERVED
from outbox_kafka.relay.claim import check_binary_attributes, check_envelope
from outbox_kafka.stored_headers import headers_from_json, headers_from_text
from tests.support import EVENT_SCHEMAS, GOOD_TRACEPARENT, ORDER_CREATED

DUE = datetime(2026, 3, 4, 5, 6, 7, 890, tzinfo=timezone(timedelta(hours=2)))
#: One value of each type, and what it is sent as: JSON member, then header text.
EXTENSIONS: dict[str, Any] = {
    "tenant": "acme",
    "homepage": "https://shop.example/orders?id=o-1",
    "retries": 3,
    "negative": -(2**31),
    "urgent": True,
    "replay": False,
    "signature": b"\x00\xff\x10",
    "due": DUE,
    "greeting": "grüß dich ✓",
}
AS_JSON: dict[str, Any] = {
    "tenant": "acme",
    "homepage": "https://shop.example/orders?id=o-1",
    "retries": 3,
    "negative": -2147483648,
    "urgent": True,
    "replay": False,
    "signature": "AP8Q",
    "due": "2026-03-04T03:06:07.000890Z",
    "greeting": "grüß dich ✓",
}
AS_HEADERS: dict[str, bytes] = {
    "ce_tenant": b"acme",
    "ce_homepage": b"https://shop.example/orders?id=o-1",
    "ce_retries": b"3",
    "ce_negative": b"-2147483648",
    "ce_urgent": b"true",
    "ce_replay": b"false",
    "ce_signature": b"AP8Q",
    "ce_due": b"2026-03-04T03:06:07.000890Z",
    "ce_greeting": "grüß dich ✓".encode(),
}


def outbox_in(mode: str, **options: Any) -> Outbox:
    return Outbox(
        schema_dir=EVENT_SCHEMAS,
        routes={"order.*": "orders"},
        content_mode=mode,  # type: ignore[arg-type]
        **options,
    )


def sent_bytes(encoded: EncodedEvent) -> int:
    """Key, value and headers, counted as the limit counts them."""
    headers = sum(len(name.encode()) + len(value) for name, value in encoded.headers)
    return len(encoded.key.encode()) + len(encoded.value) + headers


def event(**fields: Any) -> Event:
    return Event(type="order.created", key="o-1", data=ORDER_CREATED, **fields)


def test_structured_mode_makes_them_members_of_the_envelope() -> None:
    encoded = outbox_in("structured").encode(event(extensions=EXTENSIONS))
    envelope = json.loads(encoded.value)
    assert {name: envelope[name] for name in EXTENSIONS} == AS_JSON
    # After the library's attributes, in the order given, before data.
    names = list(envelope)
    assert names[names.index("partitionkey") + 2 : -1] == list(EXTENSIONS)
    assert names[-1] == "data"
    assert {name: encoded.envelope[name] for name in EXTENSIONS} == AS_JSON
    # No ce_ header: structured mode stays structured to every reader.
    assert encoded.headers == [("content-type", b"application/cloudevents+json")]
    assert check_envelope(encoded.value, str(encoded.event_id), "o-1") is None


def test_binary_mode_makes_them_ce_headers_in_their_string_encoding() -> None:
    encoded = outbox_in("binary", id_header="id").encode(
        event(extensions=EXTENSIONS, traceparent=GOOD_TRACEPARENT, headers={"tenant": "x"})
    )
    names = [name for name, _ in encoded.headers]
    extension_headers = [f"ce_{name}" for name in EXTENSIONS]
    # The library's ce_ headers, then the extensions, then the W3C traceparent, the id and
    # the producer's own headers.
    start = names.index("ce_traceparent") + 1
    assert names[start:] == [*extension_headers, "traceparent", "id", "tenant"]
    assert {name: value for name, value in encoded.headers if name in AS_HEADERS} == AS_HEADERS
    assert json.loads(encoded.value) == ORDER_CREATED
    assert check_binary_attributes(encoded.headers, str(encoded.event_id), "o-1") is None


@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_stored_headers_read_back_exactly(mode: str) -> None:
    encoded = outbox_in(mode).encode(event(extensions=EXTENSIONS))
    stored = json.loads(encoded.stored_headers)
    assert headers_from_json(stored) == encoded.headers
    # As jsonb prints it, which is what the relay reads.
    assert headers_from_text(json.dumps(stored)) == encoded.headers


@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_the_size_limit_counts_the_extensions(mode: str) -> None:
    outbox = outbox_in(mode, max_message_bytes=2048)
    size = sent_bytes(outbox.encode(event()))
    # An extension that takes the message past the limit by one byte, counted as sent.
    overhead = len(',"big":""') if mode == "structured" else len("ce_big")
    filler = "x" * (2048 - size - overhead + 1)
    with pytest.raises(MessageTooLarge, match="2049 bytes, over the maximum of 2048"):
        outbox.encode(event(extensions={"big": filler}))
    fits = outbox.encode(event(extensions={"big": filler[1:]}))
    assert sent_bytes(fits) == 2048


def test_subclasses_are_sent_as_their_plain_values() -> None:
    class Level(IntEnum):
        HIGH = 7

    class Region(StrEnum):
        EU = "eu-west"

    encoded = outbox_in("binary").encode(
        event(extensions={"level": Level.HIGH, "region": Region.EU})
    )
    headers = dict(encoded.headers)
    assert headers["ce_level"] == b"7" and headers["ce_region"] == b"eu-west"
    envelope = json.loads(
        outbox_in("structured").encode(event(extensions={"level": Level.HIGH})).value
    )
    assert envelope["level"] == 7


def test_no_extensions_leaves_the_message_as_before() -> None:
    outbox = outbox_in("structured")
    assert (
        json.loads(outbox.encode(event(extensions={})).value).keys()
        == json.loads(outbox.encode(event()).value).keys()
    )


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("Tenant", "'Tenant' is not a CloudEvents attribute name: use lower-case ASCII"),
        ("tenant-id", "'tenant-id' is not a CloudEvents attribute name"),
        ("tenant_id", "'tenant_id' is not a CloudEvents attribute name"),
        ("", "'' is not a CloudEvents attribute name"),
        ("tenänt", "'tenänt' is not a CloudEvents attribute name"),
        ("a" * 21, "'a{21}' is 21 characters, over the 20 CloudEvents recommends"),
    ],
)
def test_a_bad_name_is_refused(name: str, problem: str) -> None:
    with pytest.raises(InvalidAttribute, match=f"^extensions: {problem}"):
        outbox_in("structured").encode(event(extensions={name: "x"}))


def test_a_name_of_twenty_characters_is_accepted() -> None:
    name = "a" * 20
    encoded = outbox_in("structured").encode(event(extensions={name: "x"}))
    assert json.loads(encoded.value)[name] == "x"
    assert check_envelope(encoded.value, str(encoded.event_id), "o-1") is None


def test_a_name_that_is_not_a_str_is_refused() -> None:
    with pytest.raises(InvalidAttribute, match="attribute name 7 must be a str, not int"):
        outbox_in("structured").encode(event(extensions={7: "x"}))


@pytest.mark.parametrize(
    "name",
    [
        "id",
        "source",
        "type",
        "specversion",
        "time",
        "subject",
        "datacontenttype",
        "dataschema",
        "data",
        "partitionkey",
        "traceparent",
        "tracestate",
    ],
)
@pytest.mark.parametrize("mode", ["structured", "binary"])
def test_a_name_the_library_sets_is_refused(name: str, mode: str) -> None:
    with pytest.raises(
        InvalidAttribute, match=f"^extensions: '{name}' is an attribute outbox-kafka sets itself"
    ):
        outbox_in(mode).encode(event(extensions={name: "x"}))


def test_data_base64_is_refused_too() -> None:
    # Not a name the spec allows (an underscore), and reserved by the JSON format anyway.
    assert "data_base64" in RESERVED
    with pytest.raises(InvalidAttribute, match="'data_base64' is not a CloudEvents attribute"):
        outbox_in("structured").encode(event(extensions={"data_base64": "AA=="}))


def test_a_traceparent_extension_cannot_replace_the_events_own() -> None:
    """The tracing extension is the library's: refused whether or not the event has one, so
    neither overwrites the other."""
    for given in (None, GOOD_TRACEPARENT):
        with pytest.raises(
            InvalidAttribute, match=r"distributed-tracing extension.*pass traceparent="
        ):
            outbox_in("binary").encode(
                event(traceparent=given, extensions={"traceparent": GOOD_TRACEPARENT})
            )
    with pytest.raises(InvalidAttribute, match=r"'tracestate' .* belongs to one traceparent"):
        outbox_in("structured").encode(event(extensions={"tracestate": "vendor=1"}))
    # Nor as a header of the producer's own.
    with pytest.raises(InvalidHeaders, match="'ce_tenant'"):
        outbox_in("structured").encode(event(headers={"ce_tenant": "acme"}))


@pytest.mark.parametrize(
    ("value", "kind"),
    [
        (1.5, "float"),
        (None, "NoneType"),
        ({"a": 1}, "dict"),
        (["a"], "list"),
        (date(2026, 1, 1), "date"),
        (Decimal("1.5"), "Decimal"),
        (uuid.UUID(int=1), "UUID"),
        (timedelta(seconds=1), "timedelta"),
    ],
)
def test_a_value_of_a_type_cloudevents_cannot_carry_is_refused(value: object, kind: str) -> None:
    with pytest.raises(
        InvalidAttribute,
        match=f"^extensions: 'tenant': a {kind} is not a type a CloudEvents attribute can carry "
        r"\(Boolean, Integer, String, Binary, URI, URI-reference or Timestamp",
    ):
        outbox_in("structured").encode(event(extensions={"tenant": value}))


@pytest.mark.parametrize("number", [2**31, -(2**31) - 1, 10**30])
def test_an_integer_beyond_32_bits_is_refused(number: int) -> None:
    with pytest.raises(
        InvalidAttribute,
        match=f"'count': {number} is outside the CloudEvents Integer range "
        r"\(-2147483648 to 2147483647, 32-bit signed\)",
    ):
        outbox_in("binary").encode(event(extensions={"count": number}))


def test_the_integer_range_ends_are_accepted() -> None:
    encoded = outbox_in("binary").encode(event(extensions={"low": -(2**31), "high": 2**31 - 1}))
    headers = dict(encoded.headers)
    assert headers["ce_low"] == b"-2147483648" and headers["ce_high"] == b"2147483647"


@pytest.mark.parametrize(
    ("text", "code"),
    [
        ("a\nb", "000A"),
        ("a\x00", "0000"),
        ("\x85", "0085"),
        ("\ud800", "D800"),
        ("\ufffe", "FFFE"),
        ("\U0010ffff", "10FFFF"),
        ("\ufdd0", "FDD0"),
    ],
)
def test_a_string_a_cloudevents_string_may_not_be_is_refused(text: str, code: str) -> None:
    with pytest.raises(
        InvalidAttribute, match=f"'note' holds U\\+{code}, which a CloudEvents String"
    ):
        outbox_in("binary").encode(event(extensions={"note": text}))


def test_a_naive_or_unrepresentable_datetime_is_refused() -> None:
    with pytest.raises(InvalidAttribute, match="'due' is a naive datetime"):
        outbox_in("structured").encode(event(extensions={"due": datetime(2026, 1, 1)}))
    early = datetime(1, 1, 1, tzinfo=timezone(timedelta(hours=1)))
    with pytest.raises(
        InvalidAttribute, match="'due': 0001-01-01T00:00:00\\+01:00 is out of range"
    ):
        outbox_in("structured").encode(event(extensions={"due": early}))
    late = datetime(9999, 12, 31, 23, 59, 59, tzinfo=UTC)
    assert (
        dict(outbox_in("binary").encode(event(extensions={"due": late})).headers)["ce_due"]
        == b"9999-12-31T23:59:59.000000Z"
    )


def test_a_value_too_long_as_text_is_refused() -> None:
    with pytest.raises(
        InvalidAttribute, match="'note' is 4097 characters as text, over the maximum of 4096"
    ):
        outbox_in("structured").encode(event(extensions={"note": "x" * 4097}))
    with pytest.raises(InvalidAttribute, match="'blob' is 4100 characters as text"):
        outbox_in("structured").encode(event(extensions={"blob": b"x" * 3075}))


def test_extensions_that_are_not_a_mapping_are_refused() -> None:
    with pytest.raises(
        InvalidAttribute, match="must be a mapping of attribute name to value, not list"
    ):
        outbox_in("structured").encode(event(extensions=[("tenant", "acme")]))
