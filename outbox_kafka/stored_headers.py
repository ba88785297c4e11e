"""The stored form of an event's Kafka headers, written by the producer and read by the relay.

The outbox keeps an event's headers in a jsonb column as ``[[name, value], ...]``.
A value that is UTF-8 text without NUL is stored as that text; any other
value as ``{"base64": ...}``. Reading the stored form gives back exactly the
bytes that were written. :func:`message_size` counts a message with its
headers as Kafka's limits do.
"""

from __future__ import annotations

import base64
import json
import re
from collections.abc import Callable

#: The structured-mode content type: the first header of every event the library writes.
CONTENT_TYPE = "application/cloudevents+json"
CONTENT_TYPE_HEADER = ("content-type", CONTENT_TYPE.encode())

_json_string: Callable[[str], str] = json.encoder.encode_basestring
#: Characters JSON strings may not hold unescaped (jsonb prints them escaped).
_CONTROL = re.compile("[\x00-\x1f]")


def stored_header(name: str, value: bytes) -> str:
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


#: :data:`CONTENT_TYPE_HEADER` as stored.
STORED_CONTENT_TYPE = stored_header(*CONTENT_TYPE_HEADER)


def headers_to_json(headers: list[tuple[str, bytes]]) -> str:
    """Headers as stored: ``[[name, value], ...]``, binary values as ``{"base64": ...}``.

    PostgreSQL's jsonb cannot hold NUL characters, so values containing NUL
    are stored as base64 too; the bytes sent are always the bytes given.
    """
    return "[" + ",".join(stored_header(name, value) for name, value in headers) + "]"


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


#: How jsonb prints the stored headers of a structured-mode event with no other header.
_CONTENT_TYPE_ONLY = f'[["content-type", "{CONTENT_TYPE}"]]'
#: How jsonb prints the stored headers of a structured-mode event with more, up to the
#: second header's name.
_STRUCTURED_HEAD = f'[["content-type", "{CONTENT_TYPE}"], ["'
#: The headers from the second on, by the text around the second's value (the event's
#: id, under the outbox's id header or, in events stored by earlier versions, ``ce_id``):
#: the same for every event of one kind. Filled by the claim threads of one process
#: (dict operations are atomic).
_header_tails: dict[tuple[str, str], tuple[tuple[str, bytes], ...]] = {}
_HEADER_TAILS_KEPT = 256


def headers_from_text(stored: str) -> list[tuple[str, bytes]] | None:
    """The headers to send from jsonb's text form of the stored headers; None when malformed.

    Events of one kind differ at most in their second header's value (their
    id), so what comes around it is read once and kept (for a bounded number
    of such forms).
    """
    if stored == _CONTENT_TYPE_ONLY:
        return [CONTENT_TYPE_HEADER]
    if stored.startswith(_STRUCTURED_HEAD):
        name_start = len(_STRUCTURED_HEAD)
        name_end = stored.find('", "', name_start)
        value_end = stored.find('"', name_end + 4)
        # With no quote in the name and no backslash before the value's end, the name
        # and the value are the text between the quotes, exactly.
        if (
            name_end > 0
            and value_end > 0
            and '"' not in stored[name_start:name_end]
            and "\\" not in stored[:value_end]
        ):
            form = (stored[:name_end], stored[value_end:])
            known = _header_tails.get(form)
            text = stored[name_end + 4 : value_end]
            if known is not None and _CONTROL.search(text) is None:
                try:
                    return [CONTENT_TYPE_HEADER, (known[0][0], text.encode()), *known[1:]]
                except UnicodeEncodeError:
                    return None
            headers = _read_headers_text(stored)
            # A form with a traceparent (taken from the producer's span, say) is
            # one event's own: kept, such forms would crowd out the shared ones.
            if (
                headers is not None
                and len(headers) > 1
                and len(_header_tails) < _HEADER_TAILS_KEPT
                and '"traceparent"' not in form[1]
            ):
                _header_tails[form] = tuple(headers[1:])
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
    if "\\" not in stored and "{" not in stored and _CONTROL.search(stored) is None:
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
            try:
                values = [value.encode() for value in parts[3::4]]
            except UnicodeEncodeError:
                return None  # a lone surrogate: not text jsonb prints
            return list(zip(parts[1::4], values, strict=True))
    try:
        return headers_from_json(json.loads(stored))
    except (ValueError, RecursionError):
        return None


def message_size(key: bytes, value: bytes, headers: list[tuple[str, bytes]]) -> int:
    """Bytes a message occupies before Kafka's own record overhead."""
    return len(key) + len(value) + headers_size(headers)


def headers_size(headers: list[tuple[str, bytes]]) -> int:
    """Bytes the headers' names (UTF-8) and values occupy."""
    size = 0
    for name, value in headers:
        # An ASCII name is as long in bytes as in characters: no encoding needed.
        size += len(value) + (len(name) if name.isascii() else len(name.encode("utf-8")))
    return size
