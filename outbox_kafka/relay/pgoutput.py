"""The part of PostgreSQL's logical replication protocol (the ``pgoutput`` plugin,
protocol version 1) that the log source reads: transaction boundaries and logical
decoding messages.

With ``messages 'true'`` and a publication that names no table, a slot's stream
holds, per committed transaction that emitted a message: Begin, its transactional
messages in the order they were emitted, Commit. A non-transactional message
(``pg_logical_emit_message(false, ...)``) comes on its own, at once, whether its
transaction commits or not. Every other kind of protocol message (relations,
types, origins, row changes of a publication that names tables) is returned as
:class:`Other` and needs nothing from the log source.

Layouts, from PostgreSQL's "Logical Replication Message Formats" (protocol 1):

* Begin ``B``: final LSN of the transaction (Int64), commit time (Int64,
  microseconds since 2000-01-01), xid (Int32);
* Commit ``C``: flags (Int8, unused), commit LSN (Int64), end LSN of the
  transaction (Int64), commit time (Int64);
* Message ``M``: flags (Int8; 1 = transactional), LSN of the message (Int64),
  prefix (a zero-terminated string), content length (Int32), content.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

_BEGIN = struct.Struct(">qqi")
_COMMIT = struct.Struct(">bqqq")
_MESSAGE_HEAD = struct.Struct(">bq")
_LENGTH = struct.Struct(">i")

#: Seconds from the Unix epoch to PostgreSQL's (2000-01-01 00:00:00 UTC).
POSTGRES_EPOCH_OFFSET = 946_684_800


class Begin(NamedTuple):
    final_lsn: int
    #: Commit time, seconds since the Unix epoch.
    committed_at: float
    xid: int


class Commit(NamedTuple):
    commit_lsn: int
    #: The LSN just past the transaction's commit record: what to acknowledge once
    #: everything up to and including this transaction has been delivered.
    end_lsn: int
    committed_at: float


class Message(NamedTuple):
    transactional: bool
    lsn: int
    prefix: str
    content: bytes


class Other(NamedTuple):
    """A protocol message the log source has no use for; ``kind`` is its type byte."""

    kind: str


Decoded = Begin | Commit | Message | Other


class ProtocolError(ValueError):
    """A replication message that is not what protocol version 1 says it is."""


def _seconds(pg_micros: int) -> float:
    return pg_micros / 1_000_000 + POSTGRES_EPOCH_OFFSET


def decode(payload: bytes) -> Decoded:
    """One message of the stream (the payload of one XLogData)."""
    if not payload:
        raise ProtocolError("empty replication message")
    kind = payload[0]
    try:
        if kind == 0x42:  # B
            final_lsn, micros, xid = _BEGIN.unpack_from(payload, 1)
            return Begin(final_lsn, _seconds(micros), xid & 0xFFFFFFFF)
        if kind == 0x43:  # C
            _, commit_lsn, end_lsn, micros = _COMMIT.unpack_from(payload, 1)
            return Commit(commit_lsn, end_lsn, _seconds(micros))
        if kind == 0x4D:  # M
            return _message(payload)
    except struct.error as exc:
        raise ProtocolError(f"truncated {chr(kind)!r} message: {exc}") from None
    return Other(chr(kind))


def _message(payload: bytes) -> Message:
    flags, lsn = _MESSAGE_HEAD.unpack_from(payload, 1)
    start = 1 + _MESSAGE_HEAD.size
    end = payload.find(b"\0", start)
    if end < 0:
        raise ProtocolError("'M' message: its prefix has no terminating zero byte")
    prefix = payload[start:end].decode("utf-8", errors="replace")
    (length,) = _LENGTH.unpack_from(payload, end + 1)
    body = end + 1 + _LENGTH.size
    content = payload[body : body + length]
    if length < 0 or len(content) != length:
        raise ProtocolError(
            f"'M' message: content of {length} bytes announced, {len(payload) - body} present"
        )
    return Message(bool(flags & 1), lsn, prefix, bytes(content))
