"""Checks of what a producer passes for one event: key, topic, type, attributes, headers.

Each check returns the value in the form the envelope encoding uses, or
raises the :class:`~outbox_kafka.EventError` subclass that names the field.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta

from outbox_kafka.errors import (
    ConfigurationError,
    EventError,
    InvalidAttribute,
    InvalidEventType,
    InvalidHeaders,
    InvalidKey,
    InvalidTimestamp,
)

#: Header names the library writes itself; producers may not set them.
RESERVED_HEADERS = frozenset(
    {"content-type", "ce_id", "ce_type", "ce_source", "ce_specversion", "traceparent"}
)

_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_MAX_ATTRIBUTE = 4096

HeaderValue = str | bytes
HeadersInput = Mapping[str, HeaderValue] | Sequence[tuple[str, HeaderValue]]


def check_key(key: object, max_bytes: int) -> bytes:
    """Return the ordering key as UTF-8 (the Kafka message key), or raise."""
    if not isinstance(key, str):
        raise InvalidKey(
            "key",
            f"must be a str, not {type(key).__name__} (pass str(key), spelt the same way "
            "every time: two spellings of one value are two keys, with no order between them)",
        )
    if not key:
        raise InvalidKey("key", "must not be empty")
    if "\x00" in key:
        raise InvalidKey("key", "must not contain NUL characters")
    try:
        encoded = key.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKey("key", f"is not valid Unicode ({exc.reason})") from exc
    if len(encoded) > max_bytes:
        raise InvalidKey(
            "key", f"is {len(encoded)} bytes in UTF-8, over the maximum of {max_bytes}"
        )
    return encoded


def check_type(event_type: object) -> str:
    if not isinstance(event_type, str):
        raise InvalidEventType("type", f"must be a str, not {type(event_type).__name__}")
    if not event_type.strip():
        raise InvalidEventType("type", "must not be empty")
    _check_text("type", event_type, InvalidEventType)
    return event_type


def _check_text(field: str, value: str, error: type[InvalidAttribute | InvalidEventType]) -> None:
    if "\x00" in value:
        raise error(field, "must not contain NUL characters")
    if len(value) > _MAX_ATTRIBUTE:
        raise error(field, f"is {len(value)} characters, over the maximum of {_MAX_ATTRIBUTE}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise error(field, f"is not valid Unicode ({exc.reason})") from exc


def check_attribute(field: str, value: object) -> str:
    """Check a free-text CloudEvents attribute such as ``source`` or ``subject``."""
    if not isinstance(value, str):
        raise InvalidAttribute(field, f"must be a str, not {type(value).__name__}")
    if not value:
        raise InvalidAttribute(field, "must not be empty")
    _check_text(field, value, InvalidAttribute)
    return value


def check_traceparent(value: object) -> str:
    """Check a W3C Trace Context ``traceparent`` header value."""
    if not isinstance(value, str):
        raise InvalidAttribute("traceparent", f"must be a str, not {type(value).__name__}")
    match = _TRACEPARENT.fullmatch(value)
    if not match:
        raise InvalidAttribute(
            "traceparent", f"{value!r} is not a W3C traceparent (version-traceid-parentid-flags)"
        )
    version, trace_id, parent_id, _ = match.groups()
    if version == "ff":
        raise InvalidAttribute("traceparent", "version ff is forbidden")
    if trace_id == "0" * 32 or parent_id == "0" * 16:
        raise InvalidAttribute("traceparent", "trace id and parent id must not be all zeros")
    return value


def check_event_id(value: object) -> uuid.UUID:
    if isinstance(value, uuid.UUID):
        return value
    raise InvalidAttribute("event_id", f"must be a uuid.UUID, not {type(value).__name__}")


def check_available_at(value: object) -> datetime:
    """Return ``value`` if it is an aware datetime that exists in UTC, else raise.

    It is written to the database in UTC (PostgreSQL refuses offsets Python
    allows: beyond ±15:59, or with seconds), so it must have a UTC form.
    """
    if not isinstance(value, datetime):
        raise InvalidTimestamp("available_at", f"must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidTimestamp(
            "available_at", "is naive; pass a time-zone-aware datetime (e.g. tz=UTC)"
        )
    try:
        value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise InvalidTimestamp(
            "available_at", f"{value.isoformat()} is out of range in UTC"
        ) from None
    return value


#: The longest delay accepted: far beyond any use, well inside PostgreSQL's intervals.
MAX_DELAY = timedelta(days=100 * 366)


def cannot_hold(field: str, index: int | None = None) -> EventError:
    """The refusal of an event's ``field`` (``delay`` or ``available_at``) by an outbox
    that writes to the log, whatever its value."""
    return EventError(
        field,
        "an outbox that writes to the log sends each event once its transaction "
        "commits and cannot hold one back; use an outbox that writes to its "
        "tables (write_to='table') for delayed events",
        index=index,
    )


def check_delay(value: object, available_at: object) -> float:
    """``value`` in seconds if it is a timedelta from zero to :data:`MAX_DELAY`, else raise.

    A delay counts from the database's ``now()``, the start of the transaction
    that writes the event (not the call), so a skewed application clock does
    not shift it; ``available_at`` is for absolute times, and only one of the
    two may be given.
    """
    if available_at is not None:
        raise InvalidTimestamp(
            "delay", "give available_at (an absolute time) or delay (from now), not both"
        )
    if not isinstance(value, timedelta):
        raise InvalidTimestamp("delay", f"must be a datetime.timedelta, not {type(value).__name__}")
    if value < timedelta(0):
        raise InvalidTimestamp("delay", f"must not be negative, got {value}")
    if value > MAX_DELAY:
        raise InvalidTimestamp("delay", f"must be at most {MAX_DELAY.days} days, got {value}")
    return value.total_seconds()


#: Header names the Kafka binding of CloudEvents gives to attributes.
_ATTRIBUTE_PREFIX = "ce_"


def check_id_header(name: object) -> str | None:
    """Check the name of the header an outbox puts each event's id in (``Outbox(id_header=)``)."""
    if name is None:
        return None
    if not isinstance(name, str) or not name:
        raise ConfigurationError(f"id_header must be a non-empty str, not {name!r}")
    if any(c.isspace() or not c.isprintable() for c in name):
        raise ConfigurationError(
            f"id_header {name!r} holds a space, a control character or another character "
            "that is not printable"
        )
    if name.lower().startswith(_ATTRIBUTE_PREFIX):
        raise ConfigurationError(
            f"id_header {name!r} starts with {_ATTRIBUTE_PREFIX!r}: such headers are "
            "CloudEvents attributes in the Kafka binding (in binary mode the event's own; "
            "in structured mode a reader that finds one takes the message for binary "
            "mode); choose another name, such as 'id' (Debezium's outbox router's)"
        )
    if name.lower() in RESERVED_HEADERS:
        raise ConfigurationError(f"id_header {name!r} is a header outbox-kafka sets itself")
    return name


def check_headers(headers: object, id_header: str | None = None) -> list[tuple[str, bytes]]:
    """Normalise producer headers to ``[(name, bytes)]``, in the order given.

    Names the library sets are refused: ``content-type``, ``traceparent``,
    the outbox's ``id_header``, and every ``ce_`` name (CloudEvents attributes,
    which would make readers take the message for binary mode).
    """
    if headers is None:
        return []
    if isinstance(headers, Mapping):
        items = list(headers.items())
    elif isinstance(headers, (list, tuple)):
        items = list(headers)
    else:
        raise InvalidHeaders(
            "headers", f"must be a mapping or a list of pairs, not {type(headers).__name__}"
        )
    result: list[tuple[str, bytes]] = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2):
            raise InvalidHeaders("headers", f"entry {item!r} is not a (name, value) pair")
        name, value = item
        if not isinstance(name, str) or not name:
            raise InvalidHeaders("headers", f"header name {name!r} must be a non-empty str")
        if "\x00" in name:
            raise InvalidHeaders("headers", f"header name {name!r} contains a NUL character")
        lowered = name.lower()
        if lowered in RESERVED_HEADERS:
            raise InvalidHeaders("headers", f"header {name!r} is set by outbox-kafka itself")
        if lowered.startswith(_ATTRIBUTE_PREFIX):
            raise InvalidHeaders(
                "headers",
                f"header {name!r}: names starting with {_ATTRIBUTE_PREFIX!r} are CloudEvents "
                "attributes in the Kafka binding (in binary mode the library writes them; in "
                "structured mode a reader that finds one takes the message for binary mode); "
                "choose another name",
            )
        if id_header is not None and lowered == id_header.lower():
            raise InvalidHeaders(
                "headers",
                f"header {name!r} is the outbox's id_header: outbox-kafka sets it to the event id",
            )
        if isinstance(value, bytes):
            encoded = value
        elif isinstance(value, str):
            try:
                encoded = value.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise InvalidHeaders(
                    "headers", f"value of {name!r} is not valid Unicode ({exc.reason})"
                ) from exc
        else:
            raise InvalidHeaders(
                "headers", f"value of {name!r} must be str or bytes, not {type(value).__name__}"
            )
        try:
            name.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidHeaders("headers", f"header name {name!r} is not valid Unicode") from exc
        result.append((name, encoded))
    return result
