"""The CloudEvents 1.0 envelope: event ids, attribute checks and encoding.

An event is encoded once, at enqueue time, into exactly the bytes and headers
the relay will send: the value is the structured-mode JSON envelope, and the
headers carry the envelope's identity so consumers can route and deduplicate
without parsing the value.
"""

from __future__ import annotations

import base64
import json
import os
import re
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any, NamedTuple

from outbox_kafka.errors import (
    InvalidAttribute,
    InvalidData,
    InvalidEventType,
    InvalidHeaders,
    InvalidKey,
    InvalidTimestamp,
    InvalidTopic,
)

SPEC_VERSION = "1.0"
CONTENT_TYPE = "application/cloudevents+json"
DATA_CONTENT_TYPE = "application/json"
#: Header names the library writes itself; producers may not set them.
RESERVED_HEADERS = frozenset(
    {"content-type", "ce_id", "ce_type", "ce_source", "ce_specversion", "traceparent"}
)

_TOPIC = re.compile(r"[a-zA-Z0-9._-]{1,249}")
_TRACEPARENT = re.compile(r"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")
_MAX_ATTRIBUTE = 4096

HeaderValue = str | bytes
HeadersInput = Mapping[str, HeaderValue] | Sequence[tuple[str, HeaderValue]]


#: Random bytes fetched per system call: enough for several hundred ids.
_RANDOM_BLOCK = 4096


class _UUID7:
    """UUIDv7 (RFC 9562): 48-bit millisecond time, then random bits.

    Ids made by one process are strictly increasing: within a millisecond the
    12-bit ``rand_a`` field is used as a counter. The random bits come from
    ``os.urandom`` a block at a time rather than one system call per id; a
    forked child drops the block it inherited, so parent and child never hand
    out the same random bits.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0
        self._random = b""
        self._offset = 0
        _generators.add(self)

    def _after_fork(self) -> None:
        self._lock = threading.Lock()
        self._random = b""
        self._offset = 0

    def _next(self) -> int:
        with self._lock:
            ms = time.time_ns() // 1_000_000
            random, offset = self._random, self._offset
            if offset + 10 > len(random):
                random = self._random = os.urandom(_RANDOM_BLOCK)
                offset = 0
            if ms > self._last_ms:
                self._last_ms = ms
                self._counter = int.from_bytes(random[offset : offset + 2], "big") & 0x7FF
                offset += 2
            else:
                self._counter += 1
                if self._counter > 0xFFF:
                    self._last_ms += 1
                    self._counter = 0
                ms = self._last_ms
            counter = self._counter
            tail = int.from_bytes(random[offset : offset + 8], "big") & ((1 << 62) - 1)
            self._offset = offset + 8
        return (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | tail

    def __call__(self) -> uuid.UUID:
        return uuid.UUID(int=self._next())

    def with_text(self) -> tuple[uuid.UUID, str]:
        """A new id and its canonical text form (what ``str()`` gives), made together."""
        value = self._next()
        h = f"{value:032x}"
        return uuid.UUID(int=value), f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


_generators: weakref.WeakSet[_UUID7] = weakref.WeakSet()


def _reset_generators_in_child() -> None:
    for generator in list(_generators):
        generator._after_fork()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_generators_in_child)

uuid7 = _UUID7()


def check_key(key: object, max_bytes: int) -> bytes:
    """Return the ordering key as UTF-8 (the Kafka message key), or raise."""
    if not isinstance(key, str):
        raise InvalidKey("key", f"must be a str, not {type(key).__name__}")
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


def check_topic(topic: object) -> str:
    """Return ``topic`` if it is a legal Kafka topic name, else raise."""
    if not isinstance(topic, str):
        raise InvalidTopic("topic", f"must be a str, not {type(topic).__name__}")
    if topic in {".", ".."}:
        raise InvalidTopic("topic", f"{topic!r} is not allowed as a Kafka topic name")
    if not _TOPIC.fullmatch(topic):
        if len(topic) > 249:
            raise InvalidTopic("topic", f"is {len(topic)} characters, over Kafka's limit of 249")
        raise InvalidTopic(
            "topic",
            f"{topic!r} is not a legal Kafka topic name (use ASCII letters, digits, '.', '_', '-')",
        )
    return topic


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


def check_delay(value: object, available_at: object) -> float:
    """``value`` in seconds if it is a timedelta from zero to :data:`MAX_DELAY`, else raise.

    A delay counts from the database's ``now()`` when the event is written, so
    a skewed application clock does not shift it; ``available_at`` is for
    absolute times, and only one of the two may be given.
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


def check_headers(headers: object) -> list[tuple[str, bytes]]:
    """Normalise producer headers to ``[(name, bytes)]``, in the order given."""
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
        if name.lower() in RESERVED_HEADERS:
            raise InvalidHeaders("headers", f"header {name!r} is set by outbox-kafka itself")
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


#: One encoder for every payload: ``json.dumps`` with these options builds a new one per call.
_DATA_ENCODER = json.JSONEncoder(allow_nan=False, ensure_ascii=False, separators=(",", ":"))


def encode_data(data: Any) -> str:
    """Serialise the payload as strict JSON (no NaN or Infinity), or raise."""
    try:
        return _DATA_ENCODER.encode(data)
    except ValueError as exc:
        raise InvalidData("data", f"is not strict JSON: {exc}") from exc
    except (TypeError, RecursionError) as exc:
        raise InvalidData("data", f"is not JSON-serializable: {exc}") from exc


_json_string: Callable[[str], str] = json.encoder.encode_basestring
_second_prefix: tuple[int, str] = (-1, "")


def _rfc3339_now() -> str:
    """The current UTC time as RFC 3339 with microseconds, e.g. ``2026-12-02T13:44:04.278459Z``."""
    global _second_prefix
    micros = time.time_ns() // 1000
    second, fraction = divmod(micros, 1_000_000)
    cached_second, prefix = _second_prefix
    if second != cached_second:
        prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        _second_prefix = (second, prefix)
    return f"{prefix}.{fraction:06d}Z"


class EncodedEvent(NamedTuple):
    """An event as it will be stored and sent."""

    event_id: uuid.UUID
    key: str
    topic: str
    type: str
    value: bytes
    headers: list[tuple[str, bytes]]
    available_at: datetime | None
    #: The envelope's attributes (everything but ``data``), as encoded in ``value``.
    envelope: dict[str, Any]
    #: ``headers`` as the outbox stores them: :func:`headers_to_json` of them.
    stored_headers: str
    #: Seconds after the database's ``now()`` at insert before it may be sent.
    delay_seconds: float | None = None


_CONTENT_TYPE_HEADER = ("content-type", CONTENT_TYPE.encode())
#: Every envelope starts so, and then comes its id.
_ENVELOPE_HEAD = '{"specversion":' + _json_string(SPEC_VERSION) + ',"id":"'
#: The length of an id's text form, the value of the ``ce_id`` header.
_ID_TEXT_BYTES = 36


class EnvelopeTemplate:
    """What the envelopes and headers of one event type from one source share.

    Made once per (type, source, dataschema) and kept, so that encoding an
    event only splices in what is its own: id, time, key, subject,
    traceparent, payload and the producer's headers. The result is the same,
    byte for byte, as encoding every attribute one by one. ``event_type`` and
    ``source`` must have been checked (``check_type``, ``check_attribute``).
    """

    __slots__ = (
        "_after_id",
        "_after_time",
        "_dataschema_member",
        "_header_bytes",
        "_headers_after_id",
        "_stored_after_id",
        "dataschema",
        "event_type",
        "source",
    )

    def __init__(self, event_type: str, source: str, dataschema: str | None) -> None:
        event_type, source = _exact_str(event_type), _exact_str(source)
        self.event_type = event_type
        self.source = source
        self.dataschema = dataschema
        self._after_id = (
            f'","source":{_json_string(source)},"type":{_json_string(event_type)},"time":"'
        )
        self._after_time = f'","datacontenttype":{_json_string(DATA_CONTENT_TYPE)},"partitionkey":'
        self._dataschema_member = (
            "" if dataschema is None else f',"dataschema":{_json_string(dataschema)}'
        )
        self._headers_after_id = [
            ("ce_type", event_type.encode("utf-8")),
            ("ce_source", source.encode("utf-8")),
            ("ce_specversion", SPEC_VERSION.encode()),
        ]
        self._stored_after_id = '"],' + ",".join(
            _stored_header(name, value) for name, value in self._headers_after_id
        )
        self._header_bytes = (
            sum(
                len(name.encode("utf-8")) + len(value)
                for name, value in (_CONTENT_TYPE_HEADER, *self._headers_after_id)
            )
            + len("ce_id")
            + _ID_TEXT_BYTES
        )

    def envelope(
        self,
        event_id: str,
        key: str,
        data_json: str,
        subject: str | None = None,
        traceparent: str | None = None,
    ) -> tuple[dict[str, Any], bytes]:
        """The envelope's attributes as a dict (for validation) and the bytes to send.

        ``event_id`` is the id's text form; ``data_json`` is the already
        serialised payload, spliced in rather than serialised a second time.
        """
        now = _rfc3339_now()
        if type(key) is not str:
            key = _exact_str(key)
        envelope: dict[str, Any] = {
            "specversion": SPEC_VERSION,
            "id": event_id,
            "source": self.source,
            "type": self.event_type,
            "time": now,
            "datacontenttype": DATA_CONTENT_TYPE,
            "partitionkey": key,
        }
        optional = ""
        if subject is not None:
            subject = _exact_str(subject)
            envelope["subject"] = subject
            optional = f',"subject":{_json_string(subject)}'
        if self.dataschema is not None:
            envelope["dataschema"] = self.dataschema
            optional += self._dataschema_member
        if traceparent is not None:
            traceparent = _exact_str(traceparent)
            envelope["traceparent"] = traceparent
            optional += f',"traceparent":{_json_string(traceparent)}'
        # The id (hex and dashes) and the time (digits and punctuation) need no escaping.
        text = (
            f"{_ENVELOPE_HEAD}{event_id}{self._after_id}{now}{self._after_time}"
            f'{_json_string(key)}{optional},"data":{data_json}}}'
        )
        try:
            value = text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidData(
                "data", f"contains text that is not valid Unicode ({exc.reason})"
            ) from exc
        return envelope, value

    def headers(
        self,
        event_id: str,
        traceparent: str | None = None,
        own: list[tuple[str, bytes]] | None = None,
    ) -> tuple[list[tuple[str, bytes]], str, int]:
        """The message headers, their stored form and their size in bytes.

        The library's headers come first (``content-type``, ``ce_id``,
        ``ce_type``, ``ce_source``, ``ce_specversion``, ``traceparent`` when
        given), then the producer's ``own``, as checked by ``check_headers``.
        """
        headers = [_CONTENT_TYPE_HEADER, ("ce_id", event_id.encode()), *self._headers_after_id]
        stored = f'[{_STORED_CONTENT_TYPE},["ce_id","{event_id}{self._stored_after_id}'
        size = self._header_bytes
        if traceparent is not None:
            headers.append(("traceparent", traceparent.encode()))
            stored += f',["traceparent",{_json_string(traceparent)}]'
            size += len("traceparent") + len(traceparent)
        if own:
            headers += own
            stored += "," + ",".join(_stored_header(name, value) for name, value in own)
            size += sum(len(name.encode("utf-8")) + len(value) for name, value in own)
        return headers, stored + "]", size


def _exact_str(text: str) -> str:
    """``text`` as a plain ``str`` of the same characters, as JSON and UTF-8 encoding see it.

    A subclass (a str enum, say) is copied: the schema validator takes only
    plain strings, and ``str()`` could give its ``__str__`` instead.
    """
    return text if type(text) is str else str.__str__(text)


def _stored_header(name: str, value: bytes) -> str:
    """One header as stored: ``[name, text]``, or ``[name, {"base64": ...}]``."""
    text: str | None = None
    if b"\x00" not in value:
        try:
            text = value.decode("utf-8")
        except UnicodeDecodeError:
            text = None
    if text is None:
        encoded = base64.b64encode(value).decode("ascii")
        return f'[{_json_string(name)},{{"base64":"{encoded}"}}]'
    return f"[{_json_string(name)},{_json_string(text)}]"


_STORED_CONTENT_TYPE = _stored_header(*_CONTENT_TYPE_HEADER)


def headers_to_json(headers: list[tuple[str, bytes]]) -> str:
    """Headers as stored: ``[[name, value], ...]``, binary values as ``{"base64": ...}``.

    PostgreSQL's jsonb cannot hold NUL characters, so values containing NUL
    are stored as base64 too; the bytes sent are always the bytes given.
    """
    return "[" + ",".join(_stored_header(name, value) for name, value in headers) + "]"


def headers_from_json(stored: object) -> list[tuple[str, bytes]] | None:
    """The headers to send from their stored form; None when the row is malformed."""
    if type(stored) is not list:
        return None
    headers: list[tuple[str, bytes]] = []
    append = headers.append
    for item in stored:
        if type(item) is not list or len(item) != 2:
            return None
        name, value = item
        if type(name) is not str:
            return None
        if type(value) is str:
            append((name, value.encode("utf-8")))
        elif type(value) is dict and type(value.get("base64")) is str:
            try:
                append((name, base64.b64decode(value["base64"], validate=True)))
            except ValueError:
                return None
        else:
            return None
    return headers


#: How jsonb prints the stored headers of every event the library wrote, up to its id.
_LIBRARY_HEADERS_HEAD = f'[["content-type", "{CONTENT_TYPE}"], ["ce_id", "'
#: The headers after ``ce_id`` by the text after the id: the same for every
#: event of one type and source without a traceparent or headers of its own.
_header_tails: dict[str, tuple[tuple[str, bytes], ...]] = {}
_HEADER_TAILS_KEPT = 256


def headers_from_text(stored: str) -> list[tuple[str, bytes]] | None:
    """The headers to send from jsonb's text form of the stored headers; None when malformed.

    Events of one type and source differ only in their id, so what follows
    the id is read once and kept (for a bounded number of such tails).
    """
    if stored.startswith(_LIBRARY_HEADERS_HEAD):
        start = len(_LIBRARY_HEADERS_HEAD)
        end = stored.find('"', start)
        event_id = stored[start:end]
        if end > 0 and "\\" not in event_id:
            tail = stored[end:]
            known = _header_tails.get(tail)
            if known is not None:
                return [_CONTENT_TYPE_HEADER, ("ce_id", event_id.encode()), *known]
            headers = _read_headers_text(stored)
            if headers is not None and len(_header_tails) < _HEADER_TAILS_KEPT:
                _header_tails[tail] = tuple(headers[2:])
            return headers
    return _read_headers_text(stored)


def _read_headers_text(stored: str) -> list[tuple[str, bytes]] | None:
    """Read the stored headers' text in full.

    jsonb prints ``[["name", "value"], ...]`` with ``", "`` between items. When
    the text holds no backslash (no escaped character) and no object (no
    base64 value), every double quote delimits a string, so splitting on quotes
    yields the names and values; the separators are checked, and anything else
    goes through the JSON parser.
    """
    if stored == "[]":
        return []
    if "\\" not in stored and "{" not in stored:
        parts = stored.split('"')
        # [[ name , value ], [ name , value ]]  ->  4 parts per header, plus the ends.
        count = len(parts) >> 2
        if (
            len(parts) == 4 * count + 1
            and parts[0] == "[["
            and parts[-1] == "]]"
            and parts[2::4].count(", ") == count
            and parts[4::4].count("], [") == count - 1
        ):
            return list(zip(parts[1::4], [value.encode() for value in parts[3::4]], strict=True))
    try:
        return headers_from_json(json.loads(stored))
    except (ValueError, RecursionError):
        return None


def message_size(key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> int:
    """Bytes a message occupies before Kafka's own record overhead."""
    return len(key) + len(value) + sum(len(n.encode("utf-8")) + len(v) for n, v in headers)
