"""CloudEvents extension attributes an event carries: their names, their types, their encoding.

``Event(extensions={name: value})`` adds attributes of the producer's own to
the envelope: top-level members of the JSON envelope in structured mode,
``ce_<name>`` headers in binary mode. A name is what CloudEvents 1.0 allows
(lower-case ASCII letters and digits) and at most 20 characters, the most
the specification recommends and what ``schemas/cloudevent.json`` (checked
again by the relay) holds names to. The attributes the library sets itself
are refused, and so is any value of a type CloudEvents cannot carry.

Each type of the CloudEvents type system comes from one Python type, and is
sent so (the header is its canonical string encoding, UTF-8):

========================  ==========================  ==================================
Python value              JSON member (structured)    ``ce_`` header (binary)
========================  ==========================  ==================================
``bool`` (Boolean)        ``true`` / ``false``        ``true`` / ``false``
``int`` (Integer)         a number                    its decimal digits, ``-`` if below 0
``str`` (String, URI,     a string                    the text itself
URI-reference)
``bytes`` (Binary)        base64 text (RFC 4648)      the same base64 text
aware ``datetime``        RFC 3339 text in UTC,       the same text
(Timestamp)               microseconds, ``Z``
========================  ==========================  ==================================

A binary-mode reader gets every attribute as text (the binding has no
types); a structured-mode reader gets booleans and integers as JSON's own.
"""

from __future__ import annotations

import base64
import re
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Final

from outbox_kafka.errors import InvalidAttribute

#: What a producer may give as an extension's value.
ExtensionValue = bool | int | str | bytes | datetime
#: An extension's value as the envelope holds it: a Binary or a Timestamp is its text.
EncodedValue = bool | int | str

FIELD: Final = "extensions"
MAX_NAME_CHARS: Final = 20
#: The longest string encoding of a value, as for the library's own text attributes.
MAX_VALUE_CHARS: Final = 4096
INTEGER_MIN: Final = -(2**31)
INTEGER_MAX: Final = 2**31 - 1

_NAME = re.compile(r"[a-z0-9]+")
#: Characters a CloudEvents String may not hold: controls (C0, DEL, C1), lone surrogates
#: and Unicode's noncharacters (U+FDD0 to U+FDEF and the last two code points of each plane).
_NOT_STRING = re.compile(
    "[\x00-\x1f\x7f-\x9f\ud800-\udfff\ufdd0-\ufdef"
    + "".join(f"{chr(plane << 16 | 0xFFFE)}{chr(plane << 16 | 0xFFFF)}" for plane in range(17))
    + "]"
)

#: Attribute names outbox-kafka writes itself, and where their value comes from instead.
RESERVED: Final[Mapping[str, str]] = {
    "specversion": "the CloudEvents version, always 1.0",
    "id": "the event id: pass event_id= to choose it",
    "source": "pass source= (or Outbox(source=))",
    "type": "pass type=",
    "time": "the time of enqueue",
    "subject": "pass subject=",
    "datacontenttype": "the data's content type, application/json",
    "dataschema": "the $id of the event type's schema in Outbox(schema_dir=)",
    "data": "the event's payload: pass data=",
    "data_base64": "the name the JSON format gives binary data",
    "partitionkey": "the partitioning extension, the event's ordering key: pass key=",
    "traceparent": (
        "the distributed-tracing extension, which outbox-kafka writes itself from "
        "traceparent= or the current OpenTelemetry span, in the envelope and in the W3C "
        "header; pass traceparent= so the two always agree"
    ),
    "tracestate": (
        "part of the distributed-tracing extension, which outbox-kafka owns: a tracestate "
        "belongs to one traceparent, and outbox-kafka may write the traceparent itself "
        "(from the current span), so one given apart from it could describe another trace"
    ),
}

_TYPES = (
    "Boolean, Integer, String, Binary, URI, URI-reference or Timestamp: pass a bool, "
    "an int, a str, bytes or a time-zone-aware datetime"
)


def check_extensions(extensions: object) -> tuple[tuple[str, EncodedValue], ...]:
    """``(name, value)`` for each extension, in the order given, encoded, or raise.

    Raises :class:`~outbox_kafka.InvalidAttribute` (field ``extensions``) naming
    the attribute: a name CloudEvents does not allow, or longer than 20
    characters; a name outbox-kafka sets itself; a value of a type CloudEvents
    cannot carry, an Integer outside 32 bits, a String with characters a
    String may not hold, a naive datetime, or a string encoding over 4096
    characters.
    """
    if extensions is None:
        return ()
    if not isinstance(extensions, Mapping):
        raise InvalidAttribute(
            FIELD,
            f"must be a mapping of attribute name to value, not {type(extensions).__name__}",
        )
    return tuple(
        (check_name(name), encode_value(name, value)) for name, value in extensions.items()
    )


def check_name(name: object) -> str:
    """``name`` if it may name an extension attribute, else raise."""
    if not isinstance(name, str):
        raise InvalidAttribute(
            FIELD, f"attribute name {name!r} must be a str, not {type(name).__name__}"
        )
    if not _NAME.fullmatch(name):
        raise InvalidAttribute(
            FIELD,
            f"{name!r} is not a CloudEvents attribute name: use lower-case ASCII letters "
            "(a-z) and digits (0-9) only",
        )
    if len(name) > MAX_NAME_CHARS:
        raise InvalidAttribute(
            FIELD,
            f"{name!r} is {len(name)} characters, over the {MAX_NAME_CHARS} CloudEvents "
            "recommends as the most (and schemas/cloudevent.json allows)",
        )
    reason = RESERVED.get(name)
    if reason is not None:
        raise InvalidAttribute(
            FIELD, f"{name!r} is an attribute outbox-kafka sets itself ({reason})"
        )
    return str.__str__(name)


def encode_value(name: str, value: object) -> EncodedValue:
    """The value of extension ``name`` as the envelope holds it, or raise."""
    encoded: EncodedValue
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        number = int.__index__(value)
        if not INTEGER_MIN <= number <= INTEGER_MAX:
            raise InvalidAttribute(
                FIELD,
                f"{name!r}: {number} is outside the CloudEvents Integer range "
                f"({INTEGER_MIN} to {INTEGER_MAX}, 32-bit signed); send a larger number "
                "as a str",
            )
        return number
    if isinstance(value, str):
        encoded = str.__str__(value)
        bad = _NOT_STRING.search(encoded)
        if bad is not None:
            raise InvalidAttribute(
                FIELD,
                f"{name!r} holds U+{ord(bad.group()):04X}, which a CloudEvents String may "
                "not (control characters, lone surrogates and noncharacters); send bytes "
                "(Binary) instead",
            )
    elif isinstance(value, (bytes, bytearray)):
        encoded = base64.b64encode(value).decode("ascii")
    elif isinstance(value, datetime):
        encoded = _timestamp(name, value)
    else:
        raise InvalidAttribute(
            FIELD,
            f"{name!r}: a {type(value).__name__} is not a type a CloudEvents attribute "
            f"can carry ({_TYPES})",
        )
    if len(encoded) > MAX_VALUE_CHARS:
        raise InvalidAttribute(
            FIELD,
            f"{name!r} is {len(encoded)} characters as text, over the maximum of {MAX_VALUE_CHARS}",
        )
    return encoded


def header_text(value: EncodedValue) -> str:
    """The canonical string encoding of an encoded value: its ``ce_`` header in binary mode."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    return str(value)


def _timestamp(name: str, value: datetime) -> str:
    """An aware datetime as RFC 3339 in UTC, with microseconds, as the ``time`` attribute."""
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidAttribute(
            FIELD, f"{name!r} is a naive datetime; pass a time-zone-aware one (e.g. tz=UTC)"
        )
    try:
        utc = value.astimezone(UTC)
    except (OverflowError, ValueError):
        raise InvalidAttribute(
            FIELD, f"{name!r}: {value.isoformat()} is out of range in UTC"
        ) from None
    return utc.replace(tzinfo=None).isoformat(timespec="microseconds") + "Z"
