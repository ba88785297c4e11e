"""The log mode's frame: what the producer writes, the relay reads back whole."""

from __future__ import annotations

import struct
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_kafka.log_frames import (
    FRAME_VERSION,
    FramedEvent,
    FrameError,
    decode_frame,
    encode_frame,
)

_TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=30)
_EVENTS = st.lists(
    st.builds(
        FramedEvent,
        st.uuids(),
        _TEXT,
        _TEXT,
        _TEXT,
        st.lists(st.tuples(_TEXT, st.binary(max_size=20)), max_size=4),
        st.binary(max_size=200),
    ),
    max_size=5,
)


@given(_EVENTS)
def test_any_events_come_back_as_they_went_in(events: list[FramedEvent]) -> None:
    assert decode_frame(encode_frame(events)) == events


def test_the_layout_is_the_documented_one() -> None:
    event_id = uuid.UUID(int=1)
    frame = encode_frame(
        [FramedEvent(event_id, "k", "orders", "order.paid", [("ce_id", b"1")], b"{}")]
    )
    assert frame == (
        bytes([FRAME_VERSION])
        + struct.pack(">I", 1)
        + event_id.bytes
        + b"\0\0\0\x01k"
        + b"\0\0\0\x06orders"
        + b"\0\0\0\x0aorder.paid"
        + b"\0\x01"
        + b"\0\0\0\x05ce_id"
        + b"\0\0\0\x011"
        + b"\0\0\0\x02{}"
    )


def _one() -> bytes:
    return encode_frame([FramedEvent(uuid.UUID(int=7), "key", "t", "e", [("h", b"v")], b"value")])


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        (b"", "the frame's head needs 5 bytes"),
        (b"\x02" + struct.pack(">I", 0), "frame version 2, this relay reads 1"),
        (_one()[:-1], "event 1 of 1: its value needs 5 bytes"),
        (_one() + b"x", "1 bytes after the frame's 1 events"),
        (bytes([1]) + struct.pack(">I", 2) + _one()[5:], "event 2 of 2: its id needs 16"),
        (
            bytes([1]) + struct.pack(">I", 1) + bytes(16) + struct.pack(">I", 1) + b"\xff",
            "event 1 of 1: its key is not UTF-8",
        ),
    ],
)
def test_a_bad_frame_is_named(frame: bytes, reason: str) -> None:
    with pytest.raises(FrameError, match=reason):
        decode_frame(frame)


def test_too_many_headers_are_refused() -> None:
    event = FramedEvent(uuid.UUID(int=1), "k", "t", "e", [("h", b"")] * 0x10000, b"")
    with pytest.raises(FrameError, match="more than 65,535 headers"):
        encode_frame([event])
