"""Helpers and test data shared by the test tiers (not fixtures: plain values)."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy.engine import make_url

from outbox_kafka import (
    DataSchemaViolation,
    EventError,
    InvalidAttribute,
    InvalidData,
    InvalidEventType,
    InvalidHeaders,
    InvalidKey,
    InvalidTimestamp,
    InvalidTopic,
    MessageTooLarge,
    MissingTopic,
    UnknownEventType,
)
from outbox_kafka.limits import DEFAULT_MAX_MESSAGE_BYTES

REPO = Path(__file__).resolve().parent.parent
EVENT_SCHEMAS = REPO / "schemas" / "events"

#: A payload that satisfies schemas/events/order.created.json.
ORDER_CREATED: dict[str, Any] = {
    "order_id": "o-1",
    "customer_id": "c-1",
    "items": [{"sku": "sku-1", "quantity": 2, "unit_price_cents": 250}],
    "total_cents": 500,
    "currency": "EUR",
}

#: A payload that satisfies schemas/events/order.paid.json.
ORDER_PAID: dict[str, Any] = {
    "order_id": "o-1",
    "payment_id": "p-1",
    "amount_cents": 500,
    "currency": "EUR",
}

GOOD_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def valid_event(**overrides: Any) -> dict[str, Any]:
    """Keyword arguments of a valid ``enqueue`` call for the ``outbox`` fixture."""
    kwargs: dict[str, Any] = {"type": "order.created", "key": "order-1", "data": ORDER_CREATED}
    kwargs.update(overrides)
    return kwargs


def libpq_url(url: str) -> str:
    """A SQLAlchemy URL as a libpq URI, for psql and psycopg2.connect."""
    return make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)


@dataclass(frozen=True)
class BadInput:
    """One invalid ``enqueue`` call: overrides of :func:`valid_event` and the expected error."""

    id: str
    overrides: dict[str, Any]
    error: type[EventError]
    field: str
    #: Text the message must contain besides the field name.
    mentions: tuple[str, ...] = ()


class _NotJson:
    pass


BAD_INPUTS: list[BadInput] = [
    # data
    BadInput("data-object", {"data": {**ORDER_CREATED, "extra": _NotJson()}}, InvalidData, "data"),
    BadInput("data-set", {"data": {**ORDER_CREATED, "items": {1, 2}}}, InvalidData, "data"),
    BadInput("data-bare-object", {"data": object()}, InvalidData, "data"),
    BadInput(
        "data-nan", {"data": {**ORDER_CREATED, "total_cents": float("nan")}}, InvalidData, "data"
    ),
    BadInput(
        "data-inf", {"data": {**ORDER_CREATED, "total_cents": float("inf")}}, InvalidData, "data"
    ),
    BadInput(
        "data-minus-inf",
        {"data": {**ORDER_CREATED, "total_cents": float("-inf")}},
        InvalidData,
        "data",
    ),
    BadInput(
        "data-schema-pattern",
        {"data": {**ORDER_CREATED, "currency": "eur"}},
        DataSchemaViolation,
        "data",
        ("currency",),
    ),
    BadInput(
        "data-schema-missing",
        {"data": {k: v for k, v in ORDER_CREATED.items() if k != "order_id"}},
        DataSchemaViolation,
        "data",
        ("order_id",),
    ),
    BadInput(
        "data-schema-extra",
        {"data": {**ORDER_CREATED, "unexpected": 1}},
        DataSchemaViolation,
        "data",
        ("unexpected",),
    ),
    BadInput(
        "data-too-large",
        {"data": {**ORDER_CREATED, "customer_id": "x" * DEFAULT_MAX_MESSAGE_BYTES}},
        MessageTooLarge,
        "data",
        (str(DEFAULT_MAX_MESSAGE_BYTES),),
    ),
    # key
    BadInput("key-empty", {"key": ""}, InvalidKey, "key"),
    BadInput("key-nul", {"key": "a\x00b"}, InvalidKey, "key", ("NUL",)),
    BadInput("key-1025-ascii", {"key": "k" * 1025}, InvalidKey, "key", ("1025",)),
    BadInput("key-1025-bytes-2-byte-chars", {"key": "é" * 512 + "k"}, InvalidKey, "key", ("1025",)),
    BadInput(
        "key-1025-bytes-3-byte-chars", {"key": "€" * 341 + "kk"}, InvalidKey, "key", ("1025",)
    ),
    BadInput(
        "key-1026-bytes-4-byte-chars", {"key": "𝄞" * 256 + "kk"}, InvalidKey, "key", ("1026",)
    ),
    BadInput("key-surrogate", {"key": "a\ud800"}, InvalidKey, "key"),
    BadInput("key-not-str", {"key": 42}, InvalidKey, "key"),
    # topic
    BadInput("topic-empty", {"topic": ""}, InvalidTopic, "topic"),
    BadInput("topic-space", {"topic": "a b"}, InvalidTopic, "topic"),
    BadInput("topic-slash", {"topic": "a/b"}, InvalidTopic, "topic"),
    BadInput("topic-250", {"topic": "t" * 250}, InvalidTopic, "topic", ("250",)),
    BadInput("topic-dot", {"topic": "."}, InvalidTopic, "topic"),
    BadInput("topic-dotdot", {"topic": ".."}, InvalidTopic, "topic"),
    BadInput("topic-non-ascii", {"topic": "tópic"}, InvalidTopic, "topic"),
    BadInput("topic-not-str", {"topic": 7}, InvalidTopic, "topic"),
    BadInput(
        "topic-unrouted", {"type": "invoice.created"}, MissingTopic, "topic", ("invoice.created",)
    ),
    # type
    BadInput("type-empty", {"type": ""}, InvalidEventType, "type"),
    BadInput("type-blank", {"type": "   "}, InvalidEventType, "type"),
    BadInput("type-nul", {"type": "order.\x00created"}, InvalidEventType, "type"),
    BadInput(
        "type-unknown", {"type": "order.refunded"}, UnknownEventType, "type", ("order.refunded",)
    ),
    # available_at
    BadInput(
        "available-at-naive",
        {"available_at": datetime(2030, 1, 1)},
        InvalidTimestamp,
        "available_at",
    ),
    BadInput(
        "available-at-str",
        {"available_at": "2030-01-01T00:00:00Z"},
        InvalidTimestamp,
        "available_at",
    ),
    # headers
    BadInput("header-int", {"headers": {"x-tenant": 1}}, InvalidHeaders, "headers", ("x-tenant",)),
    BadInput(
        "header-none", {"headers": {"x-tenant": None}}, InvalidHeaders, "headers", ("x-tenant",)
    ),
    BadInput("header-ce-id", {"headers": {"ce_id": "x"}}, InvalidHeaders, "headers", ("ce_id",)),
    BadInput(
        "header-ce-extension",
        {"headers": {"ce_tenant": "x"}},
        InvalidHeaders,
        "headers",
        ("ce_tenant", "binary mode"),
    ),
    BadInput(
        "header-content-type",
        {"headers": [("content-type", "text/plain")]},
        InvalidHeaders,
        "headers",
    ),
    BadInput(
        "header-reserved-any-case", {"headers": {"Content-Type": "x"}}, InvalidHeaders, "headers"
    ),
    BadInput(
        "header-traceparent",
        {"headers": {"traceparent": GOOD_TRACEPARENT}},
        InvalidHeaders,
        "headers",
    ),
    BadInput("header-empty-name", {"headers": {"": "v"}}, InvalidHeaders, "headers"),
    BadInput("header-not-pairs", {"headers": "x-tenant=1"}, InvalidHeaders, "headers"),
    BadInput("header-short-pair", {"headers": [("x-tenant",)]}, InvalidHeaders, "headers"),
    # CloudEvents attributes
    BadInput("traceparent-garbage", {"traceparent": "abc"}, InvalidAttribute, "traceparent"),
    BadInput(
        "traceparent-uppercase",
        {"traceparent": GOOD_TRACEPARENT.upper()},
        InvalidAttribute,
        "traceparent",
    ),
    BadInput(
        "traceparent-zero-trace-id",
        {"traceparent": "00-" + "0" * 32 + "-00f067aa0ba902b7-01"},
        InvalidAttribute,
        "traceparent",
    ),
    BadInput(
        "traceparent-version-ff",
        {"traceparent": "ff" + GOOD_TRACEPARENT[2:]},
        InvalidAttribute,
        "traceparent",
    ),
    BadInput("event-id-str", {"event_id": "not-a-uuid"}, InvalidAttribute, "event_id"),
    BadInput("event-id-uuid-text", {"event_id": str(uuid.uuid4())}, InvalidAttribute, "event_id"),
    BadInput("event-id-int", {"event_id": 12345}, InvalidAttribute, "event_id"),
    BadInput("source-empty", {"source": ""}, InvalidAttribute, "source"),
    BadInput("subject-empty", {"subject": ""}, InvalidAttribute, "subject"),
    BadInput("subject-nul", {"subject": "a\x00b"}, InvalidAttribute, "subject"),
]


class LogRecords(logging.Handler):
    """Keeps the records of one logger (whether or not it propagates to the root)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def actions(self, action: str) -> list[dict[str, object]]:
        """The structured fields of the records with this ``action``."""
        return [dict(vars(r)) for r in self.records if getattr(r, "action", None) == action]
