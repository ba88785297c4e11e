"""The shortcuts of the encoding path give what the general path would (no database).

Envelopes and headers are assembled from per-type templates, payloads of JSON's
own types are validated without decoding them again, ids come from a pool of
random bytes, and array parameters are built in one pass: each is checked here
against the straightforward way of doing the same thing.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import uuid
from pathlib import Path
from typing import Any

import pytest

from outbox_kafka import DataSchemaViolation, Event, MessageTooLarge, Outbox
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.producer.ids import uuid7
from outbox_kafka.schema.statements import pg_array, pg_int_array, pg_text_array
from outbox_kafka.stored_headers import headers_to_json, message_size
from tests.support import GOOD_TRACEPARENT, ORDER_CREATED

TRICKY = 'quote " backslash \\ tab \t nul-free é ☃ 𝄞 {braces, comma} NULL'


def reference_value(encoded_envelope: dict[str, Any], data: Any) -> bytes:
    """The envelope as the general JSON encoder writes it, attributes in their order."""
    document = {**encoded_envelope, "data": data}
    return json.dumps(document, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"subject": "order/1", "traceparent": GOOD_TRACEPARENT},
        {"key": TRICKY, "subject": TRICKY, "source": "urn:" + TRICKY},
        {"event_id": uuid.UUID("01234567-89ab-7def-8123-456789abcdef")},
    ],
    ids=["plain", "optional-attributes", "escaped-attributes", "given-id"],
)
def test_value_is_the_general_json_encoding(overrides: dict[str, Any]) -> None:
    box = Outbox(routes={"*": "t"})
    for event_type in ("order.created", "type " + TRICKY):
        data = {"text": TRICKY, "n": [1, 2.5, None, True]}
        encoded = box.encode(Event(**{"type": event_type, "key": "k", "data": data, **overrides}))
        assert encoded.value == reference_value(encoded.envelope, data)
        assert encoded.envelope["id"] == str(encoded.event_id)


def test_dataschema_is_spliced_in_its_place(outbox: Outbox) -> None:
    encoded = outbox.encode(Event(type="order.created", key="k", data=ORDER_CREATED, subject="s"))
    assert list(encoded.envelope)[-2:] == ["subject", "dataschema"]
    assert encoded.value == reference_value(encoded.envelope, ORDER_CREATED)


@pytest.mark.parametrize(
    "headers",
    [
        None,
        {"x-text": "v", "x-unicode": "ünï ☃"},
        [("x-bin", b"\xff\xfe"), ("x-nul", b"a\x00b"), ("x-quote", 'say "hi" \\')],
    ],
    ids=["none", "text", "binary"],
)
@pytest.mark.parametrize("traceparent", [None, GOOD_TRACEPARENT])
def test_stored_headers_and_size_match_the_headers(headers: Any, traceparent: str | None) -> None:
    def encode(max_message_bytes: int = 1_000_000) -> EncodedEvent:
        box = Outbox(routes={"*": "t"}, source="urn:" + TRICKY, max_message_bytes=max_message_bytes)
        event = Event(
            type="type " + TRICKY,
            key="clé",
            data="x" * 1_500,
            headers=headers,
            traceparent=traceparent,
        )
        return box.encode(event)

    encoded = encode()
    assert encoded.stored_headers == headers_to_json(encoded.headers)
    # The size counted from the template is the size of the headers themselves.
    size = message_size(encoded.key.encode(), encoded.value, encoded.headers)
    assert encode(max_message_bytes=size)
    with pytest.raises(MessageTooLarge, match=str(size)):
        encode(max_message_bytes=size - 1)


def test_templates_are_per_type_and_source() -> None:
    box = Outbox(routes={"a": "ta", "b": "tb"}, source="urn:default")
    first = box.encode(Event(type="a", key="k", data=1))
    other_source = box.encode(Event(type="a", key="k", data=1, source="urn:other"))
    other_type = box.encode(Event(type="b", key="k", data=1))
    again = box.encode(Event(type="a", key="k", data=1))
    assert (first.envelope["source"], first.topic) == ("urn:default", "ta")
    assert (other_source.envelope["source"], other_source.topic) == ("urn:other", "ta")
    assert (other_type.envelope["type"], other_type.topic) == ("b", "tb")
    assert (again.envelope["source"], again.envelope["type"], again.topic) == (
        "urn:default",
        "a",
        "ta",
    )


class _Text(str):
    pass


def test_str_subclass_type_and_source_encode_like_str() -> None:
    box = Outbox(routes={"*": "t"})
    encoded = box.encode(Event(type=_Text("a.b"), key="k", data=1, source=_Text("urn:x")))
    assert json.loads(encoded.value)["type"] == "a.b"
    assert json.loads(encoded.value)["source"] == "urn:x"


# --- payload validation: decoded form for anything but JSON's own types ------------------


class _Float(float):
    pass


def _schemas(tmp_path: Path, schema: dict[str, Any]) -> Outbox:
    (tmp_path / "thing.json").write_text(json.dumps(schema))
    return Outbox(schema_dir=tmp_path, routes={"*": "t"})


def test_subclass_values_are_judged_in_their_json_form(tmp_path: Path) -> None:
    # The JSON form of 1.5 is a number, whatever Python class it had.
    box = _schemas(tmp_path, {"properties": {"a": {"not": {"type": "number"}}}})
    with pytest.raises(DataSchemaViolation, match="/a"):
        box.encode(Event(type="thing", key="k", data={"a": _Float(1.5)}))
    assert box.encode(Event(type="thing", key="k", data={"a": "1.5"}))


def test_tuples_and_non_str_keys_are_judged_in_their_json_form(tmp_path: Path) -> None:
    box = _schemas(
        tmp_path,
        {
            "type": "object",
            "properties": {"1": {"type": "array", "maxItems": 2}},
            "required": ["1"],
        },
    )
    assert box.encode(Event(type="thing", key="k", data={1: (1, 2)}))
    with pytest.raises(DataSchemaViolation, match="/1"):
        box.encode(Event(type="thing", key="k", data={1: (1, 2, 3)}))


def test_large_payloads_are_validated_too(tmp_path: Path) -> None:
    box = _schemas(tmp_path, {"type": "array", "items": {"type": "integer"}})
    good = list(range(5_000))
    assert box.encode(Event(type="thing", key="k", data=good))
    with pytest.raises(DataSchemaViolation, match="/4999"):
        box.encode(Event(type="thing", key="k", data=[*good[:-1], "x"]))


def test_invalid_plain_payload_names_the_path(outbox: Outbox) -> None:
    data = {**ORDER_CREATED, "items": [{"sku": "s", "quantity": 0, "unit_price_cents": 1}]}
    with pytest.raises(DataSchemaViolation, match="/items/0/quantity"):
        outbox.encode(Event(type="order.created", key="k", data=data))


# --- ids ------------------------------------------------------------------------------------


def test_id_text_is_the_canonical_form() -> None:
    for _ in range(1_000):
        value, text = uuid7.with_text()
        assert text == str(value)
        assert value.version == 7 and value.variant == uuid.RFC_4122


def _child_tails(connection: Any) -> None:
    connection.send([uuid7().int & ((1 << 62) - 1) for _ in range(200)])
    connection.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork is POSIX only")
def test_a_forked_child_does_not_reuse_the_parents_random_bits() -> None:
    uuid7()  # the parent now holds a block of random bytes the child inherits
    context = multiprocessing.get_context("fork")
    receiving, sending = context.Pipe(duplex=False)
    child = context.Process(target=_child_tails, args=(sending,))
    child.start()
    theirs = set(receiving.recv())
    child.join(timeout=30)
    ours = {uuid7().int & ((1 << 62) - 1) for _ in range(200)}
    assert child.exitcode == 0
    assert not ours & theirs


# --- array parameters ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "values",
    [[], ["a"], ["", "NULL", TRICKY, "a,b", "{}", '\\"', "ünï"], ["x"] * 3],
    ids=["empty", "one", "tricky", "repeated"],
)
def test_text_array_is_pg_array(values: list[str]) -> None:
    assert pg_text_array(values) == pg_array(values)


def test_text_array_with_nul_takes_the_general_path() -> None:
    assert pg_text_array(["a\x00b", "c"]) == pg_array(["a\x00b", "c"])


def test_int_array_is_pg_array() -> None:
    values = [0, 1, -5, 2**40]
    assert pg_int_array(values) == pg_array(values)
    assert pg_int_array([]) == "{}"
