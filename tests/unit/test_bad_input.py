"""Every bad input raises its own OutboxError subclass, naming the field (no database)."""

from __future__ import annotations

import inspect
import uuid
from typing import Any, cast

import pytest

import outbox_kafka.errors as errors
from outbox_kafka import (
    DataSchemaViolation,
    DuplicateEventId,
    Event,
    EventError,
    InvalidKey,
    InvalidTopic,
    MessageTooLarge,
    Outbox,
    OutboxError,
)
from tests.support import BAD_INPUTS, ORDER_CREATED, BadInput, valid_event


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.id)
def test_bad_input_raises_specific_error(outbox: Outbox, case: BadInput) -> None:
    with pytest.raises(case.error) as excinfo:
        outbox.encode(Event(**valid_event(**case.overrides)))
    error = excinfo.value
    assert type(error) is case.error
    assert isinstance(error, OutboxError)
    assert isinstance(error, ValueError)
    assert error.field == case.field
    assert error.index is None
    message = str(error)
    assert message.startswith(f"{case.field}: ")
    assert error.reason and error.reason in message
    for text in case.mentions:
        assert text in message


@pytest.mark.parametrize("case", BAD_INPUTS, ids=lambda c: c.id)
def test_bad_input_rejected_before_the_connection_is_used(outbox: Outbox, case: BadInput) -> None:
    """A validation error comes before any use of the connection (a dummy here)."""
    not_a_connection = cast(Any, object())
    with pytest.raises(case.error):
        outbox.enqueue(not_a_connection, **valid_event(**case.overrides))


def test_unsafe_connection_for_a_non_connection(outbox: Outbox) -> None:
    with pytest.raises(errors.UnsafeConnection):
        outbox.enqueue(cast(Any, object()), **valid_event())


def test_valid_event_is_accepted(outbox: Outbox) -> None:
    """The base of every bad case is itself valid, so each case fails for its own reason."""
    assert outbox.encode(Event(**valid_event())).key == "order-1"


@pytest.mark.parametrize(
    "key",
    [
        "k" * 1024,
        "é" * 512,  # 2-byte characters: exactly 1024 bytes
        "€" * 341 + "k",  # 3-byte characters: 1023 + 1 bytes
        "𝄞" * 256,  # 4-byte characters: exactly 1024 bytes
        "k",
    ],
    ids=["ascii-1024", "2-byte-1024", "3-byte-1024", "4-byte-1024", "one-char"],
)
def test_key_at_the_byte_limit_is_accepted(outbox: Outbox, key: str) -> None:
    assert len(key.encode("utf-8")) <= 1024
    assert outbox.encode(Event(**valid_event(key=key))).key == key


def test_key_limit_counts_bytes_not_characters(outbox: Outbox) -> None:
    key = "é" * 513  # 513 characters, 1026 bytes
    assert len(key) < 1024 < len(key.encode())
    with pytest.raises(InvalidKey, match="1026"):
        outbox.encode(Event(**valid_event(key=key)))


def test_custom_key_limit() -> None:
    box = Outbox(routes={"*": "t"}, max_key_bytes=4)
    assert box.encode(Event(type="t", key="éé", data=1)).key == "éé"
    with pytest.raises(InvalidKey):
        box.encode(Event(type="t", key="ééa", data=1))


def test_topic_of_249_characters_is_accepted(outbox: Outbox) -> None:
    topic = "a.b_c-" + "t" * 243
    assert len(topic) == 249
    assert outbox.encode(Event(**valid_event(topic=topic))).topic == topic
    with pytest.raises(InvalidTopic):
        outbox.encode(Event(**valid_event(topic=topic + "t")))


def _message_size(box: Outbox, event: Event) -> int:
    encoded = box.encode(event)
    return (
        len(encoded.key.encode())
        + len(encoded.value)
        + sum(len(name.encode()) + len(value) for name, value in encoded.headers)
    )


def test_message_size_limit_boundary() -> None:
    event = Event(type="t", key="k", data={"blob": "x" * 3000}, headers={"x-h": "v"}, subject="s")
    size = _message_size(Outbox(routes={"*": "t"}), event)
    assert 3000 < size < 4000
    # The size is deterministic (fixed-width id and time), so the limit is exact.
    assert Outbox(routes={"*": "t"}, max_message_bytes=size).encode(event)
    with pytest.raises(MessageTooLarge) as excinfo:
        Outbox(routes={"*": "t"}, max_message_bytes=size - 1).encode(event)
    assert excinfo.value.field == "data"
    assert str(size) in str(excinfo.value)


def test_schema_violation_names_the_path(outbox: Outbox) -> None:
    data = {**ORDER_CREATED, "items": [{"sku": "s", "quantity": 0, "unit_price_cents": 1}]}
    with pytest.raises(DataSchemaViolation) as excinfo:
        outbox.encode(Event(**valid_event(data=data)))
    assert "/items/0/quantity" in str(excinfo.value)
    assert "order.created.json" in str(excinfo.value)


def test_schema_is_checked_on_the_encoded_json(outbox: Outbox) -> None:
    """A tuple is sent as a JSON array, so it satisfies an array schema."""
    data = {**ORDER_CREATED, "items": (ORDER_CREATED["items"][0],)}
    assert outbox.encode(Event(**valid_event(data=data))).envelope["type"] == "order.created"


def test_a_batch_giving_one_event_id_twice_is_refused_naming_both_before_any_write(
    outbox: Outbox,
) -> None:
    twice = uuid.uuid4()
    events = [Event(**valid_event(key=f"k{i}")) for i in range(4)]
    events[1] = Event(**valid_event(key="k1", event_id=twice))
    events[3] = Event(**valid_event(key="k3", event_id=twice))
    with pytest.raises(DuplicateEventId) as excinfo:
        outbox.enqueue_many(cast(Any, object()), events)  # refused before the connection
    assert excinfo.value.index == 3
    assert (
        str(excinfo.value)
        == f"event 3: event_id: {twice} is given twice in the batch (also event 1)"
    )


def test_batch_error_names_the_event_index(outbox: Outbox) -> None:
    events = [Event(**valid_event(key=f"k{i}")) for i in range(5)]
    events[2] = Event(**valid_event(key=""))
    with pytest.raises(InvalidKey) as excinfo:
        outbox.enqueue_many(cast(Any, object()), events)
    assert excinfo.value.index == 2
    assert str(excinfo.value).startswith("event 2: key: ")


@pytest.mark.parametrize(
    "item, text",
    [
        ({"type": "order.created", "key": "k"}, "missing"),
        ({**valid_event(), "colour": "red"}, "colour"),
        ("not an event", "str"),
    ],
    ids=["missing-field", "unknown-field", "not-a-mapping"],
)
def test_bad_batch_items(outbox: Outbox, item: Any, text: str) -> None:
    with pytest.raises(EventError) as excinfo:
        outbox.enqueue_many(cast(Any, object()), [valid_event(), item])
    assert excinfo.value.field == "events"
    assert excinfo.value.index == 1
    assert text in str(excinfo.value)


def test_every_error_class_is_an_outbox_error() -> None:
    classes = [
        obj
        for _, obj in inspect.getmembers(errors, inspect.isclass)
        if issubclass(obj, BaseException) and obj.__module__ == errors.__name__
    ]
    assert len(classes) >= 20
    for cls in classes:
        assert issubclass(cls, OutboxError), cls
    event_errors = [cls for cls in classes if issubclass(cls, EventError)]
    for cls in event_errors:
        instance = cls("field", "reason")
        assert isinstance(instance, OutboxError)
        assert str(instance) == "field: reason"
    # Each bad-input case expects a distinct, specific subclass, never the base class.
    assert EventError not in {case.error for case in BAD_INPUTS}


@pytest.mark.parametrize(
    "kwargs",
    [{"max_key_bytes": 0}, {"max_message_bytes": 1023}, {"source": ""}, {"source": "a\x00"}],
    ids=repr,
)
def test_bad_outbox_settings(kwargs: dict[str, Any]) -> None:
    with pytest.raises(errors.ConfigurationError):
        Outbox(**kwargs)
