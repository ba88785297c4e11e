"""Purging: delete delivered and discarded events past their age, in small
transactions, and forget the counters of the keys that leaves with nothing.

:func:`purge_old_events` is shared by the relay's purge task and
``outbox-kafka purge``.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from sqlalchemy import Connection, Engine, Row
from sqlalchemy.exc import ProgrammingError

from outbox_kafka.schema.statements import Queries, pg_int_array, pg_text_array

log = logging.getLogger("outbox_kafka.retention")
_INSUFFICIENT_PRIVILEGE = "42501"


def purge_old_events(
    engine: Engine,
    queries: Queries,
    *,
    delivered_seconds: float,
    discarded_seconds: float,
    batch: int,
) -> tuple[int, int]:
    """Delete delivered, then discarded events older than their retention; (delivered,
    discarded) removed.

    ``batch`` rows per transaction, so a large purge never holds long locks.
    Each transaction also deletes the counter (``outbox_key_seq`` row) of every
    key whose last event it removed, where nothing of the key is left that
    its sequence numbers order (see forget_idle_counters in queries.sql):
    without it, the counters table would keep one row per key ever used.
    """
    removed: list[int] = []
    forget_refused = False
    for name, age in (
        ("purge_delivered", delivered_seconds),
        ("purge_discarded", discarded_seconds),
    ):
        total = 0
        while True:
            with engine.begin() as conn:
                purged = conn.execute(
                    queries[name], {"older_than_seconds": age, "batch": batch}
                ).all()
                if purged and not forget_refused:
                    forget_refused = not _forget_idle_counters(conn, queries, purged)
            total += len(purged)
            if len(purged) < batch:
                break
        removed.append(total)
    return removed[0], removed[1]


def _forget_idle_counters(conn: Connection, queries: Queries, purged: Sequence[Row[Any]]) -> bool:
    """Delete the counters the purged rows leave idle; False where the role may not.

    In a savepoint: a relay role granted before counters could be deleted
    (roles.sql before schema version 5) keeps purging events, and says once
    per run what it lacks.
    """
    try:
        with conn.begin_nested():
            conn.execute(
                queries["forget_idle_counters"],
                {
                    "key_names": pg_text_array([row.ordering_key for row in purged]),
                    "seqs": pg_int_array(row.seq for row in purged),
                },
            )
    except ProgrammingError as exc:
        if getattr(exc.orig, "pgcode", None) != _INSUFFICIENT_PRIVILEGE:
            raise
        log.warning(
            "retention cannot delete the counters of idle keys: grant DELETE on them "
            "(re-run deploy/sql/roles.sql); events are still purged",
            extra={"action": "counters_kept", "error": str(exc.orig).strip()},
        )
        return False
    return True
