"""Writing encoded events into the write-ahead log, in the caller's transaction
(the log mode, ``Outbox(write_to="log")``).

One write is one call of the outbox's emit function (migration 0007) with one
frame (:mod:`outbox_kafka.log_frames`): one transactional logical decoding
message, which a relay reading the outbox's slot receives once the caller
commits, and never if the caller rolls back. Nothing is written to the outbox's
tables, so a producer pays neither the per-key counter nor the queue row; the
order of a key's events is the order their transactions commit in.

What the tables give and the log cannot: a delay (``available_at``, ``delay``;
refused here, since nothing would hold the event back) and the refusal of an
event id already used (the log keeps no index of ids; consumers deduplicate by
the id header either way).
"""

from __future__ import annotations

import uuid
from typing import Any

from outbox_kafka.log_frames import FramedEvent, encode_frame
from outbox_kafka.producer.envelope import EncodedEvent
from outbox_kafka.producer.event_checks import cannot_hold
from outbox_kafka.producer.writing import (
    Connectable,
    EnqueueFunctions,
    OutboxWriter,
    connection_of,
)

#: The write-to modes of an outbox: its tables (the default) or the write-ahead log.
WRITE_TO = ("table", "log")


class LogWriter(OutboxWriter):
    """Writes the encoded events of one outbox into the write-ahead log; thread-safe."""

    def write(
        self, conn: Connectable, encoded: list[EncodedEvent], chosen_ids: bool
    ) -> list[uuid.UUID]:
        """Emit ``encoded`` as one frame, in ``conn``'s transaction."""
        connection = connection_of(conn)
        name, params = self.statement(encoded, EnqueueFunctions(True, True), literals=True)
        if connection.dialect.driver == "psycopg2":
            connection.exec_driver_sql(self.driver_sql(name), params)
        else:
            connection.execute(self._queries[name], params)
        return [e.event_id for e in encoded]

    def statement(
        self, encoded: list[EncodedEvent], functions: EnqueueFunctions, *, literals: bool
    ) -> tuple[str, dict[str, Any]]:
        """The emit statement's name and its parameter, the frame of ``encoded``."""
        for index, event in enumerate(encoded):
            if event.available_at is not None or event.delay_seconds is not None:
                raise cannot_hold(
                    "available_at" if event.available_at is not None else "delay",
                    index if len(encoded) > 1 else None,
                )
        frame = encode_frame(
            [FramedEvent(e.event_id, e.key, e.topic, e.type, e.headers, e.value) for e in encoded]
        )
        return "emit_frame", {"frame": frame}

    def is_duplicate_id(self, driver_error: BaseException | None) -> bool:
        """Never: the log keeps no index of event ids to refuse one with."""
        return False
