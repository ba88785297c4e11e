"""The CloudEvents Kafka content modes an outbox can store its events in.

*structured* (the default): the value is the JSON envelope, laid out by
:class:`~outbox_kafka.producer.envelope.EnvelopeTemplate`. *binary*: the value
is the event's ``data`` alone, ``content-type`` is its ``datacontenttype``,
and every other attribute is a ``ce_<name>`` header, UTF-8 text as the Kafka
binding requires: the library's attributes, then the producer's extension
attributes in their canonical string encoding
(:mod:`outbox_kafka.producer.extensions`). The producer's own headers must be
UTF-8 text too (readers decode every header), and are refused otherwise.
"""

from __future__ import annotations

from typing import Any, Literal

from outbox_kafka.errors import ConfigurationError, InvalidHeaders
from outbox_kafka.producer.extensions import EncodedValue, header_text
from outbox_kafka.stored_headers import headers_size, headers_to_json

ContentMode = Literal["structured", "binary"]
CONTENT_MODES: tuple[ContentMode, ...] = ("structured", "binary")

#: The attributes of the envelope sent as ``ce_`` headers in binary mode, in this order
#: (``datacontenttype`` is the ``content-type`` header; ``data`` is the value).
_BINARY_ATTRIBUTES = (
    "specversion",
    "id",
    "source",
    "type",
    "time",
    "subject",
    "dataschema",
    "partitionkey",
    "traceparent",
)


def check_content_mode(mode: object) -> ContentMode:
    if mode == "structured":
        return "structured"
    if mode == "binary":
        return "binary"
    raise ConfigurationError(
        f"content_mode must be one of {', '.join(CONTENT_MODES)}, not {mode!r}"
    )


def binary_message(
    envelope: dict[str, Any],
    data_json: str,
    own: list[tuple[str, bytes]],
    id_header: str | None = None,
    extensions: tuple[tuple[str, EncodedValue], ...] = (),
) -> tuple[bytes, list[tuple[str, bytes]], str, int]:
    """The value, headers, stored headers and header bytes of an event in binary mode.

    ``envelope`` holds the event's attributes (checked); ``data_json`` its
    payload as JSON text; ``extensions`` the producer's extension attributes
    (checked: none is an attribute the library sets, so no ``ce_`` header
    comes twice). A W3C ``traceparent`` header follows the ``ce_`` headers
    when the event has one, for tracing tools that read that header, then the
    id under ``id_header`` when the outbox has one.
    """
    headers: list[tuple[str, bytes]] = [
        ("content-type", str(envelope["datacontenttype"]).encode("utf-8"))
    ]
    for name in _BINARY_ATTRIBUTES:
        value = envelope.get(name)
        if value is not None:
            headers.append((f"ce_{name}", str(value).encode("utf-8")))
    for name, extension in extensions:
        headers.append((f"ce_{name}", header_text(extension).encode("utf-8")))
    if envelope.get("traceparent") is not None:
        headers.append(("traceparent", str(envelope["traceparent"]).encode("ascii")))
    if id_header is not None:
        headers.append((id_header, str(envelope["id"]).encode("ascii")))
    for name, value in own:
        try:
            value.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidHeaders(
                "headers",
                f"value of {name!r} is not UTF-8 text: in binary content mode every header "
                "must be (CloudEvents readers decode them all); send it base64-encoded, or "
                "use the structured mode",
            ) from None
        headers.append((name, value))
    return data_json.encode("utf-8"), headers, headers_to_json(headers), headers_size(headers)
