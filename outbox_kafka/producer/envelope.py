"""The CloudEvents 1.0 envelope: the bytes and headers one event is sent as.

An event is encoded once, at enqueue time, into exactly the bytes and headers
the relay will send: the value is the structured-mode JSON envelope, and the
headers are ``content-type: application/cloudevents+json``, the event id under
the outbox's ``id_header`` when it has one, ``traceparent`` when the event has
one, then the producer's own. No ``ce_`` header: a reader that finds one takes
the message for binary mode. Its attributes arrive checked
(:mod:`outbox_kafka.producer.event_checks`), the producer's extension attributes
encoded (:mod:`outbox_kafka.producer.extensions`); they follow the library's
own attributes in the envelope, in the order given.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from datetime import datetime
from typing import Any, NamedTuple

from outbox_kafka.errors import InvalidData
from outbox_kafka.producer.extensions import EncodedValue
from outbox_kafka.stored_headers import (
    CONTENT_TYPE_HEADER,
    STORED_CONTENT_TYPE,
    headers_size,
    stored_header,
)

SPEC_VERSION = "1.0"
DATA_CONTENT_TYPE = "application/json"

#: One encoder for every payload: ``json.dumps`` with these options builds a new one per call.
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
    #: ``headers`` as the outbox stores them (:mod:`outbox_kafka.stored_headers`).
    stored_headers: str
    #: Seconds after the database's ``now()`` at insert before it may be sent.
    delay_seconds: float | None = None


#: Every envelope starts so, and then comes its id.
_ENVELOPE_HEAD = '{"specversion":' + _json_string(SPEC_VERSION) + ',"id":"'
_CONTENT_TYPE_BYTES = headers_size([CONTENT_TYPE_HEADER])


class EnvelopeTemplate:
    """What the envelopes of one event type from one source share.

    Made once per (type, source, dataschema) and kept, so that encoding an
    event only splices in what is its own: id, time, key, subject,
    traceparent and payload. The result is the same, byte for byte, as
    encoding every attribute one by one. ``event_type`` and ``source`` must
    have been checked (``check_type``, ``check_attribute``).
    """

    __slots__ = (
        "_after_id",
        "_after_time",
        "_dataschema_member",
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

    def envelope(
        self,
        event_id: str,
        key: str,
        data_json: str,
        subject: str | None = None,
        traceparent: str | None = None,
        extensions: tuple[tuple[str, EncodedValue], ...] = (),
    ) -> tuple[dict[str, Any], bytes]:
        """The envelope's attributes as a dict (for validation) and the bytes to send.

        ``event_id`` is the id's text form; ``data_json`` is the already
        serialised payload, spliced in rather than serialised a second time;
        ``extensions`` are checked (``check_extensions``): names of lower-case
        letters and digits, none the library sets.
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
        for name, extension in extensions:
            envelope[name] = extension
            optional += f',"{name}":{_json_value(extension)}'
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


def structured_headers(
    event_id: str,
    traceparent: str | None = None,
    own: list[tuple[str, bytes]] | None = None,
    id_header: str | None = None,
) -> tuple[list[tuple[str, bytes]], str, int]:
    """The headers of a structured-mode event, their stored form and their size in bytes.

    The library's headers come first (``content-type``; the id under
    ``id_header`` when given, checked by ``check_id_header``; ``traceparent``
    when given), then the producer's ``own``, as checked by ``check_headers``.
    The id and the traceparent need no escaping.
    """
    headers = [CONTENT_TYPE_HEADER]
    stored = f"[{STORED_CONTENT_TYPE}"
    size = _CONTENT_TYPE_BYTES
    if id_header is not None:
        headers.append((id_header, event_id.encode()))
        stored += f',[{_json_string(id_header)},"{event_id}"]'
        size += len(id_header.encode("utf-8")) + len(event_id)
    if traceparent is not None:
        headers.append(("traceparent", traceparent.encode()))
        stored += f',["traceparent",{_json_string(traceparent)}]'
        size += len("traceparent") + len(traceparent)
    if own:
        headers += own
        stored += "," + ",".join(stored_header(name, value) for name, value in own)
        size += headers_size(own)
    return headers, stored + "]", size


def _json_value(value: EncodedValue) -> str:
    """An extension's value as JSON: ``true``/``false``, a number, or a string."""
    if value is True:
        return "true"
    if value is False:
        return "false"
    if type(value) is int:
        return str(value)
    return _json_string(str(value))


def _exact_str(text: str) -> str:
    """``text`` as a plain ``str`` of the same characters, as JSON and UTF-8 encoding see it.

    A subclass (a str enum, say) is copied: the schema validator takes only
    plain strings, and ``str()`` could give its ``__str__`` instead.
    """
    return text if type(text) is str else str.__str__(text)
