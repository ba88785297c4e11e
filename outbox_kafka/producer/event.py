"""What a producer hands over: one :class:`Event`, and the :class:`Route` rules that
give a topic to events by type.

Both are plain data; the encoder (:mod:`outbox_kafka.producer.encoding`) reads
them and the outbox (:mod:`outbox_kafka.producer.outbox`) takes them from the
caller, so the arrows run from those two modules to this one.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from outbox_kafka.errors import ConfigurationError, EventError
from outbox_kafka.producer.event_checks import HeadersInput
from outbox_kafka.producer.extensions import ExtensionValue
from outbox_kafka.topic_names import check_topic


@dataclass(frozen=True)
class Event:
    """One event for :meth:`Outbox.enqueue_many`; fields as in :meth:`Outbox.enqueue`.

    ``extensions`` maps CloudEvents extension attribute names to values
    (:mod:`outbox_kafka.producer.extensions`): they are checked with the rest
    of the event when it is encoded, before anything is written.
    """

    type: str
    key: str
    data: Any
    topic: str | None = None
    headers: HeadersInput | None = None
    available_at: datetime | None = None
    event_id: uuid.UUID | None = None
    source: str | None = None
    subject: str | None = None
    traceparent: str | None = None
    delay: timedelta | None = None
    extensions: Mapping[str, ExtensionValue] | None = None


@dataclass(frozen=True)
class Route:
    """Events whose type matches ``pattern`` (an fnmatch glob) go to ``topic``."""

    pattern: str
    topic: str


_EVENT_FIELDS = frozenset(Event.__dataclass_fields__)


def event_from_mapping(item: Mapping[str, Any], index: int) -> Event:
    """The :class:`Event` a mapping of a batch describes; ``index`` names it in errors."""
    if not isinstance(item, Mapping):
        raise EventError(
            "events", f"must hold Event objects or mappings, not {type(item).__name__}", index=index
        )
    unknown = set(item) - _EVENT_FIELDS
    if unknown:
        raise EventError("events", f"unknown field(s) {sorted(unknown)}", index=index)
    missing = {"type", "key", "data"} - set(item)
    if missing:
        raise EventError("events", f"missing field(s) {sorted(missing)}", index=index)
    return Event(**item)


def routes_from(routes: Mapping[str, str] | Iterable[Route] | None) -> list[Route]:
    """The routing rules an outbox is given (``{pattern: topic}`` or routes), checked."""
    if routes is None:
        return []
    pairs = (
        [Route(p, t) for p, t in routes.items()] if isinstance(routes, Mapping) else list(routes)
    )
    for route in pairs:
        if not isinstance(route, Route) or not isinstance(route.pattern, str) or not route.pattern:
            raise ConfigurationError(f"routing rule {route!r} needs a non-empty type pattern")
        try:
            check_topic(route.topic)
        except EventError as exc:
            raise ConfigurationError(f"routing rule for {route.pattern!r}: {exc.reason}") from None
    return pairs
