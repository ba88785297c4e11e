"""The pgoutput decoder, on messages laid out as protocol version 1 documents them."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given
from hypothesis import strategies as st

from outbox_kafka.relay.pgoutput import (
    POSTGRES_EPOCH_OFFSET,
    Begin,
    Commit,
    Message,
    Other,
    ProtocolError,
    decode,
)


def begin(final_lsn: int, micros: int, xid: int) -> bytes:
    return b"B" + struct.pack(">qqi", final_lsn, micros, xid)


def commit(commit_lsn: int, end_lsn: int, micros: int) -> bytes:
    return b"C" + struct.pack(">bqqq", 0, commit_lsn, end_lsn, micros)


def message(flags: int, lsn: int, prefix: bytes, content: bytes) -> bytes:
    return (
        b"M"
        + struct.pack(">bq", flags, lsn)
        + prefix
        + b"\0"
        + struct.pack(">i", len(content))
        + content
    )


def test_begin() -> None:
    decoded = decode(begin(0x16B3748, 1_000_000, 745))
    assert decoded == Begin(0x16B3748, POSTGRES_EPOCH_OFFSET + 1.0, 745)


def test_begin_xid_is_unsigned() -> None:
    decoded = decode(begin(1, 0, -2))
    assert isinstance(decoded, Begin)
    assert decoded.xid == 2**32 - 2


def test_commit() -> None:
    assert decode(commit(100, 180, 2_500_000)) == Commit(100, 180, POSTGRES_EPOCH_OFFSET + 2.5)


def test_transactional_message() -> None:
    got = decode(message(1, 42, b"outbox-kafka:public.outbox", b"\x01frame\x00bytes"))
    assert got == Message(True, 42, "outbox-kafka:public.outbox", b"\x01frame\x00bytes")


def test_non_transactional_message() -> None:
    got = decode(message(0, 7, b"p", b""))
    assert got == Message(False, 7, "p", b"")


@pytest.mark.parametrize("kind", [b"R", b"Y", b"O", b"I", b"U", b"D", b"T"])
def test_other_kinds_are_returned_as_other(kind: bytes) -> None:
    assert decode(kind + b"\0" * 20) == Other(kind.decode())


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"", "empty"),
        (b"B\0\0", "truncated 'B'"),
        (b"C" + b"\0" * 10, "truncated 'C'"),
        (b"M\x01" + b"\0" * 8 + b"no-terminator", "no terminating zero"),
        (b"M\x01" + b"\0" * 8 + b"p\0" + struct.pack(">i", 10) + b"short", "10 bytes announced"),
        (b"M\x01" + b"\0" * 8 + b"p\0" + struct.pack(">i", -1), "-1 bytes announced"),
        (b"M\x01" + b"\0" * 8 + b"p\0\0", "truncated 'M'"),
    ],
)
def test_malformed_messages_are_named(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode(payload)


@given(
    flags=st.sampled_from([0, 1]),
    lsn=st.integers(min_value=0, max_value=2**63 - 1),
    prefix=st.text(
        alphabet=st.characters(blacklist_characters="\0", blacklist_categories=("Cs",)),
        max_size=40,
    ),
    content=st.binary(max_size=300),
)
def test_any_message_decodes_to_what_was_laid_out(
    flags: int, lsn: int, prefix: str, content: bytes
) -> None:
    assert decode(message(flags, lsn, prefix.encode(), content)) == Message(
        bool(flags), lsn, prefix, content
    )
