"""Payloads with the types services hold: encoded by default, a hook for the rest,
validated against the payload schema as encoded (no services)."""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import enum
import json
import uuid
from pathlib import Path
from typing import Any

import pydantic
import pytest

from outbox_kafka import DataSchemaViolation, Event, InvalidData, InvalidKey, Outbox
from outbox_kafka.testing import InMemoryStore


class Colour(enum.Enum):
    RED = "red"


class Size(enum.IntEnum):
    LARGE = 3


@dataclasses.dataclass
class Line:
    sku: str
    price: decimal.Decimal
    shipped: dt.date


class Customer(pydantic.BaseModel):
    id: uuid.UUID
    since: dt.datetime


class Point:
    def __init__(self, x: int, y: int) -> None:
        self.x, self.y = x, y


def _data(outbox: Outbox, data: Any) -> Any:
    encoded = outbox.encode(Event(type="t.e", key="k", topic="t", data=data))
    return json.loads(encoded.value)["data"]


def test_dates_decimals_uuids_enums_dataclasses_and_models_are_encoded() -> None:
    outbox = Outbox()
    when = dt.datetime(2026, 12, 4, 9, 30, 15, 250000, tzinfo=dt.UTC)
    ident = uuid.UUID("0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b")
    data = {
        "at": when,
        "naive": dt.datetime(2026, 12, 4, 9, 30),
        "day": dt.date(2026, 12, 4),
        "time": dt.time(9, 30, tzinfo=dt.timezone(dt.timedelta(hours=2))),
        "amount": decimal.Decimal("12.50"),
        "big": decimal.Decimal("1E+30"),
        "id": ident,
        "colour": Colour.RED,
        "size": Size.LARGE,
        "line": Line("A-1", decimal.Decimal("0.10"), dt.date(2026, 1, 2)),
        "customer": Customer(id=ident, since=when),
    }
    assert _data(outbox, data) == {
        "at": "2026-12-04T09:30:15.250000+00:00",
        "naive": "2026-12-04T09:30:00",
        "day": "2026-12-04",
        "time": "09:30:00+02:00",
        "amount": "12.50",
        "big": "1E+30",
        "id": "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
        "colour": "red",
        "size": 3,
        "line": {"sku": "A-1", "price": "0.10", "shipped": "2026-01-02"},
        # A pydantic model as pydantic writes its JSON.
        "customer": {
            "id": "0193a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b",
            "since": "2026-12-04T09:30:15.250000Z",
        },
    }


@pytest.mark.parametrize("value", [decimal.Decimal("NaN"), decimal.Decimal("-Infinity")])
def test_a_decimal_that_is_not_a_number_is_refused(value: decimal.Decimal) -> None:
    with pytest.raises(InvalidData, match="is not strict JSON"):
        _data(Outbox(), {"amount": value})


def test_another_type_is_refused_naming_it_and_the_hook() -> None:
    with pytest.raises(InvalidData) as caught:
        _data(Outbox(), {"p": Point(1, 2)})
    assert str(caught.value) == (
        "data: is not JSON-serializable: Object of type Point is not JSON serializable "
        "(Outbox(json_default=...) converts others)"
    )


def test_the_hook_converts_the_rest_and_its_refusal_is_reported() -> None:
    def points(value: Any) -> Any:
        if isinstance(value, Point):
            return [value.x, value.y]
        raise TypeError(f"cannot encode {type(value).__name__}")

    outbox = Outbox(json_default=points)
    assert _data(outbox, {"p": Point(1, 2), "at": dt.date(2026, 1, 1)}) == {
        "p": [1, 2],
        "at": "2026-01-01",
    }
    with pytest.raises(InvalidData, match=r"is not JSON-serializable: cannot encode bytes$"):
        _data(outbox, {"raw": b"\x00"})


def test_the_payload_schema_judges_the_encoded_values(tmp_path: Path) -> None:
    schema = {
        "type": "object",
        "properties": {"at": {"type": "string"}, "amount": {"type": "string"}},
        "required": ["at", "amount"],
        "additionalProperties": False,
    }
    (tmp_path / "t.e.json").write_text(json.dumps(schema))
    outbox = Outbox(schema_dir=tmp_path)
    data = {"at": dt.datetime(2026, 1, 1, tzinfo=dt.UTC), "amount": decimal.Decimal("1.00")}
    assert _data(outbox, data) == {"at": "2026-01-01T00:00:00+00:00", "amount": "1.00"}
    with pytest.raises(DataSchemaViolation):
        _data(outbox, {"at": dt.datetime(2026, 1, 1), "amount": Size.LARGE})  # 3: not a string


def test_encoded_values_reach_the_message_through_the_relay() -> None:
    from outbox_kafka.relay import Relay, RelaySettings
    from outbox_kafka.testing import StubPublisher

    store, kafka = InMemoryStore(), StubPublisher()
    outbox = store.outbox()
    outbox.enqueue(None, type="t.e", key="k", topic="t", data={"amount": decimal.Decimal("9.99")})
    settings = RelaySettings(database_url="postgresql://unused/db", bootstrap_servers="unused:1")
    Relay(settings, store=store, publisher=kafka).drain()
    (message,) = kafka.messages("t")
    assert json.loads(message.value)["data"] == {"amount": "9.99"}


@pytest.mark.parametrize("key", [7, uuid.UUID(int=7)])
def test_a_key_that_is_not_a_str_is_refused_with_the_way_out(key: object) -> None:
    with pytest.raises(InvalidKey, match=r"must be a str, not (int|UUID) \(pass str\(key\)"):
        Outbox().encode(Event(type="t.e", key=key, topic="t", data={}))  # type: ignore[arg-type]
