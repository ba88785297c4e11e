"""The frame a producer's events travel in through the write-ahead log (the log
mode): written by the producer, read by the relay.

One write (an ``enqueue`` or an ``enqueue_many``) is one logical decoding message
whose content is one frame, all integers big-endian::

    frame  = version (1 byte, 1), event count (4 bytes), event * count
    event  = id (16 bytes), key, topic, type (each text), header count (2 bytes),
             (name (text), value (bytes)) * header count, value (bytes)
    text   = length (4 bytes), UTF-8
    bytes  = length (4 bytes), the bytes

The value and headers are the Kafka message's, as the producer encoded them; the
frame adds nothing a relay would have to work out.
"""

from __future__ import annotations

import struct
import uuid
from collections.abc import Sequence
from typing import NamedTuple

FRAME_VERSION = 1

_HEAD = struct.Struct(">BI")
_LENGTH = struct.Struct(">I")
_HEADER_COUNT = struct.Struct(">H")


class FramedEvent(NamedTuple):
    event_id: uuid.UUID
    key: str
    topic: str
    type: str
    headers: list[tuple[str, bytes]]
    value: bytes


class FrameError(ValueError):
    """A frame that is not what :data:`FRAME_VERSION` lays out; the message says where."""


def _text(value: str) -> bytes:
    data = value.encode("utf-8")
    return _LENGTH.pack(len(data)) + data


def _bytes(value: bytes) -> bytes:
    return _LENGTH.pack(len(value)) + value


def encode_frame(events: Sequence[FramedEvent]) -> bytes:
    """The frame of ``events``, in order."""
    parts = [_HEAD.pack(FRAME_VERSION, len(events))]
    for event in events:
        if len(event.headers) > 0xFFFF:
            raise FrameError(f"event {event.event_id}: more than 65,535 headers")
        parts += [
            event.event_id.bytes,
            _text(event.key),
            _text(event.topic),
            _text(event.type),
            _HEADER_COUNT.pack(len(event.headers)),
        ]
        for name, value in event.headers:
            parts += [_text(name), _bytes(value)]
        parts.append(_bytes(event.value))
    return b"".join(parts)


class _Reader:
    def __init__(self, frame: bytes) -> None:
        self.frame = frame
        self.at = 0

    def take(self, n: int, what: str) -> bytes:
        end = self.at + n
        if end > len(self.frame):
            raise FrameError(
                f"{what} needs {n} bytes at offset {self.at}, the frame has {len(self.frame)}"
            )
        data = self.frame[self.at : end]
        self.at = end
        return data

    def length(self, what: str) -> int:
        (n,) = _LENGTH.unpack(self.take(_LENGTH.size, f"{what}'s length"))
        return int(n)

    def bytes(self, what: str) -> bytes:
        return self.take(self.length(what), what)

    def text(self, what: str) -> str:
        data = self.bytes(what)
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise FrameError(f"{what} is not UTF-8: {exc}") from None


def decode_frame(frame: bytes) -> list[FramedEvent]:
    """The events of ``frame``; :class:`FrameError` names what is wrong with it."""
    reader = _Reader(frame)
    version, count = _HEAD.unpack(reader.take(_HEAD.size, "the frame's head"))
    if version != FRAME_VERSION:
        raise FrameError(f"frame version {version}, this relay reads {FRAME_VERSION}")
    events = []
    for i in range(count):
        where = f"event {i + 1} of {count}"
        event_id = uuid.UUID(bytes=reader.take(16, f"{where}: its id"))
        key = reader.text(f"{where}: its key")
        topic = reader.text(f"{where}: its topic")
        event_type = reader.text(f"{where}: its type")
        (header_count,) = _HEADER_COUNT.unpack(
            reader.take(_HEADER_COUNT.size, f"{where}: its header count")
        )
        headers = [
            (reader.text(f"{where}: header {h + 1}'s name"), reader.bytes(f"{where}: header value"))
            for h in range(header_count)
        ]
        value = reader.bytes(f"{where}: its value")
        events.append(FramedEvent(event_id, key, topic, event_type, headers, value))
    if reader.at != len(frame):
        raise FrameError(f"{len(frame) - reader.at} bytes after the frame's {count} events")
    return events
