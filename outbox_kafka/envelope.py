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
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from .errors import (
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


class _UUID7:
    """UUIDv7 (RFC 9562): 48-bit millisecond time, then random bits.

    Ids made by one process are strictly increasing: within a millisecond the
    12-bit ``rand_a`` field is used as a counter.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last_ms = -1
        self._counter = 0

    def __call__(self) -> uuid.UUID:
        with self._lock:
            ms = time.time_ns() // 1_000_000
            if ms > self._last_ms:
                self._last_ms = ms
                self._counter = int.from_bytes(os.urandom(2), "big") & 0x7FF
            else:
                self._counter += 1
                if self._counter > 0xFFF:
                    self._last_ms += 1
                    self._counter = 0
                ms = self._last_ms
            counter = self._counter
        tail = int.from_bytes(os.urandom(8), "big") & ((1 << 62) - 1)
        value = (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | counter << 64 | 0b10 << 62 | tail
        return uuid.UUID(int=value)


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
    if not isinstance(value, datetime):
        raise InvalidTimestamp("available_at", f"must be a datetime, not {type(value).__name__}")
    if value.tzinfo is None or value.utcoffset() is None:
        raise InvalidTimestamp(
            "available_at", "is naive; pass a time-zone-aware datetime (e.g. tz=UTC)"
        )
    return value


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


def encode_data(data: Any) -> str:
    """Serialise the payload as strict JSON (no NaN or Infinity), or raise."""
    try:
        return json.dumps(data, allow_nan=False, ensure_ascii=False, separators=(",", ":"))
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


@dataclass(frozen=True)
class EncodedEvent:
    """An event as it will be stored and sent."""

    event_id: uuid.UUID
    key: str
    topic: str
    type: str
    value: bytes
    headers: list[tuple[str, bytes]]
    available_at: datetime | None
    envelope: dict[str, Any]


def build_envelope(
    *,
    event_id: uuid.UUID,
    source: str,
    event_type: str,
    key: str,
    data_json: str,
    subject: str | None,
    dataschema: str | None,
    traceparent: str | None,
) -> tuple[dict[str, Any], bytes]:
    """The envelope as a dict (for validation) and as the bytes to send.

    ``data_json`` is the already-serialised payload; it is spliced in rather
    than serialised a second time.
    """
    envelope: dict[str, Any] = {
        "specversion": SPEC_VERSION,
        "id": str(event_id),
        "source": source,
        "type": event_type,
        "time": _rfc3339_now(),
        "datacontenttype": DATA_CONTENT_TYPE,
        "partitionkey": key,
    }
    if subject is not None:
        envelope["subject"] = subject
    if dataschema is not None:
        envelope["dataschema"] = dataschema
    if traceparent is not None:
        envelope["traceparent"] = traceparent
    # Every attribute is a str, so the head is assembled directly; the payload
    # is spliced in as already serialised.
    head = ",".join(f"{_json_string(k)}:{_json_string(v)}" for k, v in envelope.items())
    text = "{" + head + ',"data":' + data_json + "}"
    try:
        value = text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidData(
            "data", f"contains text that is not valid Unicode ({exc.reason})"
        ) from exc
    return envelope, value


def standard_headers(
    event_id: uuid.UUID, event_type: str, source: str, traceparent: str | None
) -> list[tuple[str, bytes]]:
    """The headers every message carries, in front of the producer's own."""
    headers = [
        ("content-type", CONTENT_TYPE.encode()),
        ("ce_id", str(event_id).encode()),
        ("ce_type", event_type.encode("utf-8")),
        ("ce_source", source.encode("utf-8")),
        ("ce_specversion", SPEC_VERSION.encode()),
    ]
    if traceparent is not None:
        headers.append(("traceparent", traceparent.encode()))
    return headers


def headers_to_json(headers: list[tuple[str, bytes]]) -> str:
    """Headers as stored: ``[[name, value], ...]``, binary values as ``{"base64": ...}``.

    PostgreSQL's jsonb cannot hold NUL characters, so values containing NUL
    are stored as base64 too; the bytes sent are always the bytes given.
    """
    items: list[str] = []
    for name, value in headers:
        text: str | None = None
        if b"\x00" not in value:
            try:
                text = value.decode("utf-8")
            except UnicodeDecodeError:
                text = None
        if text is None:
            encoded = base64.b64encode(value).decode("ascii")
            items.append(f'[{_json_string(name)},{{"base64":"{encoded}"}}]')
        else:
            items.append(f"[{_json_string(name)},{_json_string(text)}]")
    return "[" + ",".join(items) + "]"


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


def message_size(key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> int:
    """Bytes a message occupies before Kafka's own record overhead."""
    return len(key) + len(value) + sum(len(n.encode("utf-8")) + len(v) for n, v in headers)
