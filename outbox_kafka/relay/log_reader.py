"""The log mode's source: one outbox's committed frames, read from its replication
slot in commit order, and the acknowledgement that lets the server discard them.

A slot has one reader at a time: while another session streams from it,
:meth:`LogReader.open` raises :class:`SlotBusy` (SQLSTATE 55006), and a relay
waits and tries again, taking over once that session has ended.

The stream is read with pgoutput, protocol 1 (never 2 with streaming, which
sends a large transaction's messages before it commits, aborted or not), from a
publication that names no table, with messages on. Per committed transaction
the reader returns the events of the frames that carry this outbox's prefix,
with the transaction's end LSN. Anything else is counted, never returned: a
message sent outside any transaction (``pg_logical_emit_message(false, ...)``,
which arrives whether or not its transaction commits), a message of another
prefix, a frame that cannot be read.

Acknowledging an end LSN tells the server that every transaction ending at or
before it is done: they are not sent again, even to a new session, and their
WAL may go. A session that ends without acknowledging is sent again, from the
first transaction after the last acknowledgement.
"""

from __future__ import annotations

import select
import time
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import psycopg2
import psycopg2.errors
import psycopg2.extras
from sqlalchemy.engine import make_url

from outbox_kafka.database import normalise_url
from outbox_kafka.errors import ConfigurationError, OutboxError
from outbox_kafka.log_frames import FramedEvent, FrameError, decode_frame
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.pgoutput import Begin, Commit, Message, ProtocolError, decode

#: The shortest a read may take: enough to take in a batch of the stream at once.
_MIN_READ_SECONDS = 0.02
#: How often a session that reads nothing still tells the server it lives.
_FEEDBACK_SECONDS = 10.0
#: libpq settings of the replication connection, which the URL's query overrides.
_CONNECTION_DEFAULTS = {
    "connect_timeout": "10",
    "keepalives": "1",
    "keepalives_idle": "30",
    "keepalives_interval": "10",
    "keepalives_count": "3",
}


class LogTransaction(NamedTuple):
    """One committed transaction's events, in the order they were written."""

    #: The LSN just past its commit: acknowledge it once it and all before it are sent.
    end_lsn: int
    #: Commit time, seconds since the Unix epoch.
    committed_at: float
    events: list[FramedEvent]


class SlotBusy(OutboxError):
    """Another session reads the slot now (a relay, or ``check`` peeking at it)."""


class SlotUnusable(ConfigurationError):
    """The slot cannot be read: it is missing, or the server gave it up (lost). Nothing
    the relay does mends it; an operator does, with ``log-setup``."""


@dataclass
class Strays:
    """What the stream held that is not this outbox's committed events."""

    #: Messages emitted outside a transaction: sent whether or not it committed.
    non_transactional: int = 0
    #: Messages of another prefix (another outbox, another tool).
    foreign: int = 0
    #: Frames of this outbox that could not be read, with why (the latest few).
    malformed: int = 0
    malformed_reasons: list[str] = field(default_factory=list)


class LogReader:
    """Reads one outbox's slot; not thread-safe (one relay loop owns it)."""

    def __init__(self, database_url: str, names: TableNames) -> None:
        #: Any URL the relay takes; its driver part does not matter here.
        self._url = normalise_url(database_url)
        self._names = names
        self._conn: Any = None
        self._cursor: Any = None
        self._current: list[FramedEvent] | None = None
        self._begin: Begin | None = None
        self.strays = Strays()
        #: The highest end LSN this session acknowledged.
        self.acknowledged = 0
        #: The position of the last message that came outside any transaction (a
        #: non-transactional message): acknowledged when nothing is in flight, so that
        #: such messages alone do not hold the slot back.
        self.idle_lsn = 0
        self._fed_back_at = 0.0

    def open(self) -> None:
        """Connect and start streaming from the slot's last acknowledgement."""
        url = make_url(self._url)
        # As SQLAlchemy's psycopg2 dialect connects: the URL's parts, then its query
        # (sslmode, a ?user= that wins over the user part, ...).
        params: dict[str, Any] = url.translate_connect_args(username="user", database="dbname")
        # A network that drops the session silently is noticed, unless the URL says otherwise.
        params.update(_CONNECTION_DEFAULTS)
        params.update(url.query)
        conn = psycopg2.connect(
            connection_factory=psycopg2.extras.LogicalReplicationConnection, **params
        )
        try:
            cursor = conn.cursor()
            cursor.start_replication(
                slot_name=self._names.log_slot,
                decode=False,
                options={
                    "proto_version": "1",
                    "publication_names": self._names.log_publication,
                    "messages": "true",
                },
            )
        except psycopg2.errors.ObjectInUse as exc:
            conn.close()
            raise SlotBusy(
                f"replication slot {self._names.log_slot} is read by another session: "
                f"{str(exc).strip()}"
            ) from None
        except (
            psycopg2.errors.UndefinedObject,
            psycopg2.errors.ObjectNotInPrerequisiteState,
        ) as exc:
            conn.close()
            raise SlotUnusable(self._unusable(exc)) from None
        except BaseException:
            conn.close()
            raise
        self._conn, self._cursor = conn, cursor
        self._current, self._begin = None, None
        # Positions are this session's: a server after a failover may be behind them.
        self.acknowledged = 0
        self.idle_lsn = 0
        self._fed_back_at = time.monotonic()

    def _unusable(self, exc: psycopg2.Error) -> str:
        """What the server said about a slot it will not stream, and what to do."""
        slot = self._names.log_slot
        said = " ".join(line.strip() for line in str(exc).strip().splitlines() if line.strip())
        if isinstance(exc, psycopg2.errors.UndefinedObject):
            remedy = "run outbox-kafka log-setup"
        else:
            remedy = (
                "if the server gave it up (lost: it held more WAL than "
                "max_slot_wal_keep_size allows), the events written since its last "
                f"acknowledgement are gone; drop it (SELECT pg_drop_replication_slot('{slot}')) "
                "and run outbox-kafka log-setup"
            )
        return f"replication slot {slot} cannot be read: {said}; {remedy}"

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = self._cursor = None

    def read(self, timeout: float, max_events: int = 10_000) -> list[LogTransaction]:
        """The transactions that commit within ``timeout`` seconds, as soon as one has,
        or as many as have arrived once ``max_events`` events are in."""
        cursor = self._cursor
        if cursor is None:
            raise RuntimeError("LogReader.read before open")
        done: list[LogTransaction] = []
        count = 0
        # However busy the stream (other prefixes' messages too), a read returns
        # within its time: the loop must acknowledge, answer and stop in between.
        deadline = time.monotonic() + max(timeout, _MIN_READ_SECONDS)
        while count < max_events:
            message = cursor.read_message()
            if message is None:
                left = deadline - time.monotonic()
                if done or left <= 0:
                    break
                select.select([cursor], [], [], left)
                continue
            finished = self._take(message.payload, message.data_start)
            if finished is not None:
                done.append(finished)
                count += len(finished.events)
            if time.monotonic() >= deadline:
                break
        return done

    def _take(self, payload: bytes, position: int) -> LogTransaction | None:
        decoded = decode(payload)
        if isinstance(decoded, Begin):
            self._begin, self._current = decoded, []
        elif isinstance(decoded, Commit):
            events, self._current, self._begin = self._current, None, None
            if events is None:
                raise ProtocolError("a Commit without its Begin")
            return LogTransaction(decoded.end_lsn, decoded.committed_at, events)
        elif isinstance(decoded, Message):
            if not decoded.transactional or self._current is None:
                self.strays.non_transactional += 1
                if self._current is None:
                    self.idle_lsn = max(self.idle_lsn, position)
            elif decoded.prefix != self._names.log_prefix:
                self.strays.foreign += 1
            else:
                try:
                    self._current.extend(decode_frame(decoded.content))
                except FrameError as exc:
                    self.strays.malformed += 1
                    self.strays.malformed_reasons = [
                        *self.strays.malformed_reasons[-9:],
                        f"at LSN {decoded.lsn:X}: {exc}",
                    ]
        return None

    def acknowledge(self, end_lsn: int) -> None:
        """Everything up to ``end_lsn`` is done: the server may forget it."""
        if self._cursor is None:
            raise RuntimeError("LogReader.acknowledge before open")
        if end_lsn <= self.acknowledged:
            return
        self.acknowledged = end_lsn
        self._cursor.send_feedback(flush_lsn=end_lsn, force=True)
        self._fed_back_at = time.monotonic()

    def keep_alive(self) -> None:
        """Tell the server this session lives, when nothing has been said for a while:
        a relay that stalls, or waits for Kafka, reads nothing, and the server ends a
        session it has not heard from within wal_sender_timeout (60 s by default)."""
        if self._cursor is None or time.monotonic() - self._fed_back_at < _FEEDBACK_SECONDS:
            return
        self._cursor.send_feedback(force=True)
        self._fed_back_at = time.monotonic()
