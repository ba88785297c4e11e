"""Names of the outbox's database objects, validated once and quoted.

Table and schema names are configurable; they end up inside SQL text, so they
are held to a strict identifier pattern here and nowhere else.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass

from outbox_kafka.errors import InvalidIdentifier

_IDENTIFIER = re.compile(r"[a-z_][a-z0-9_]*")
_MAX_IDENTIFIER = 63  # PostgreSQL truncates longer names silently
# Suffixes appended to the table name for the outbox's other objects.
_EVENT_SUFFIXES = (
    "status_check",
    "attempts_check",
    "claim_idx",
    "pending_idx",
    "delivered_idx",
    "discarded_idx",
)
_OBJECT_SUFFIXES = (
    *(f"_{s}" for s in _EVENT_SUFFIXES),
    "_keys",
    "_keys_due_idx",
    "_keys_pkey",
    "_arrivals",
    "_arrivals_pkey",
    "_floors",
    "_floors_pkey",
    "_key_seq",
    "_key_seq_pkey",
    "_migrations",
    "_migrations_pkey",
    "_enqueue_one",
    "_enqueue_many",
    "_emit",
)
_MAX_BASE = _MAX_IDENTIFIER - max(len(s) for s in _OBJECT_SUFFIXES)


def validate_identifier(value: str, what: str, *, max_length: int = 63) -> str:
    """Return ``value`` if it is a lower-case SQL identifier, else raise."""
    if not isinstance(value, str) or not _IDENTIFIER.fullmatch(value):
        raise InvalidIdentifier(
            f"{what} {value!r} is not a valid identifier: use lower-case letters, "
            "digits and underscores, starting with a letter or underscore"
        )
    if len(value) > max_length:
        raise InvalidIdentifier(f"{what} {value!r} is longer than {max_length} characters")
    return value


def _quote(identifier: str) -> str:
    return f'"{identifier}"'


@dataclass(frozen=True)
class TableNames:
    """The objects that make up one outbox: events, key counters, arrivals, key queue, floors."""

    table: str = "outbox"
    schema: str = "public"

    def __post_init__(self) -> None:
        validate_identifier(self.table, "table name", max_length=_MAX_BASE)
        validate_identifier(self.schema, "schema name")

    @property
    def events(self) -> str:
        return self.table

    @property
    def keys(self) -> str:
        return f"{self.table}_keys"

    @property
    def arrivals(self) -> str:
        return f"{self.table}_arrivals"

    @property
    def seqs(self) -> str:
        return f"{self.table}_key_seq"

    @property
    def floors(self) -> str:
        """The relay sessions' offset floors per partition (migration 0006)."""
        return f"{self.table}_floors"

    @property
    def enqueue_one(self) -> str:
        """The function that writes one event (migration 0003)."""
        return f"{self.table}_enqueue_one"

    @property
    def enqueue_one_signature(self) -> str:
        """The function's qualified name and argument types, as ``to_regprocedure`` reads them."""
        return (
            f"{_quote(self.schema)}.{_quote(self.enqueue_one)}(uuid, text, text, text, bytea, "
            "jsonb, timestamp with time zone, double precision, boolean)"
        )

    @property
    def enqueue_many(self) -> str:
        """The function that writes a batch of events (migration 0005)."""
        return f"{self.table}_enqueue_many"

    @property
    def enqueue_many_signature(self) -> str:
        """The batch function's qualified name and argument types, for ``to_regprocedure``."""
        return (
            f"{_quote(self.schema)}.{_quote(self.enqueue_many)}(uuid[], text[], text[], text[], "
            "integer[], integer[], bytea, jsonb, timestamp with time zone[], "
            "double precision[], boolean)"
        )

    @property
    def emit(self) -> str:
        """The function that puts a frame of events into the write-ahead log (migration 0007)."""
        return f"{self.table}_emit"

    @property
    def emit_signature(self) -> str:
        """The emit function's qualified name and argument types, for ``to_regprocedure``."""
        return f"{_quote(self.schema)}.{_quote(self.emit)}(bytea)"

    @property
    def log_prefix(self) -> str:
        """The prefix of this outbox's logical decoding messages (the log mode)."""
        return f"outbox-kafka:{self.schema}.{self.table}"

    @property
    def log_slot(self) -> str:
        """The replication slot the log mode's relay reads this outbox's messages from.

        A slot name is 63 bytes at most, of lower-case letters, digits and
        underscores. The schema's length comes first, so that no two outboxes
        share a name (schema ``a_b`` with table ``c`` and schema ``a`` with table
        ``b_c``); long schema and table names are replaced by a digest of both.
        Slot names are the server's, not the database's: an outbox of the same
        schema and table in another database of the server needs another server.
        """
        readable = f"outbox_kafka_{len(self.schema)}_{self.schema}_{self.table}"
        if len(readable) <= _MAX_IDENTIFIER:
            return readable
        both = f"{self.schema}\0{self.table}".encode()
        return "outbox_kafka_" + hashlib.blake2b(both, digest_size=16).hexdigest()

    @property
    def log_publication(self) -> str:
        """The publication the log mode's relay streams with: it names no table."""
        return self.log_slot

    @property
    def versions(self) -> str:
        return f"{self.table}_migrations"

    @property
    def channel(self) -> str:
        """The LISTEN/NOTIFY channel committed enqueues wake the relay on.

        Channel names are identifiers (63 bytes at most); long schema and
        table names are replaced by a digest so the name stays exact.
        """
        readable = f"outbox_kafka.{self.schema}.{self.table}"
        if len(readable) <= _MAX_IDENTIFIER:
            return readable
        digest = hashlib.blake2b(readable.encode(), digest_size=16).hexdigest()
        return f"outbox_kafka.{digest}"

    @property
    def qualified_events(self) -> str:
        return f"{self.schema}.{self.table}"

    def lock_id(self, purpose: str) -> int:
        """A stable signed 64-bit advisory-lock id for ``purpose`` on this outbox."""
        digest = hashlib.blake2b(
            f"outbox-kafka:{purpose}:{self.schema}.{self.table}".encode(), digest_size=8
        ).digest()
        return int.from_bytes(digest, "big", signed=True)

    @property
    def wake_lock(self) -> int:
        """The advisory lock an idle relay holds so that enqueues notify it."""
        return self.lock_id("wake")

    def placeholders(self) -> dict[str, str]:
        """Values for the ``{name}`` placeholders in the SQL files."""
        s = _quote(self.schema)
        values = {
            "schema": s,
            "events": f"{s}.{_quote(self.events)}",
            "keys": f"{s}.{_quote(self.keys)}",
            "seqs": f"{s}.{_quote(self.seqs)}",
            "arrivals": f"{s}.{_quote(self.arrivals)}",
            "floors": f"{s}.{_quote(self.floors)}",
            "versions": f"{s}.{_quote(self.versions)}",
            "channel": _quote(self.channel),
            "channel_literal": f"'{self.channel}'",
            "wake_lock": str(self.wake_lock),
            "enqueue_one": f"{s}.{_quote(self.enqueue_one)}",
            "enqueue_many": f"{s}.{_quote(self.enqueue_many)}",
            "emit": f"{s}.{_quote(self.emit)}",
            "log_prefix_literal": f"'{self.log_prefix}'",
            "log_slot_literal": f"'{self.log_slot}'",
            "log_publication": _quote(self.log_publication),
            "emit_signature_literal": "'" + self.emit_signature.replace("'", "''") + "'",
        }
        for suffix in _EVENT_SUFFIXES:
            values[f"events_{suffix}"] = _quote(f"{self.table}_{suffix}")
        values["keys_due_idx"] = _quote(f"{self.keys}_due_idx")
        return values
