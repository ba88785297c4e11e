"""Retention: delete delivered and discarded events past their age, in small
transactions, and forget the counters of the keys that leaves with nothing.

Shared by the relay's purge thread and ``outbox-kafka purge``.
"""

from __future__ import annotations

from sqlalchemy import Engine

from .queries import Queries, pg_int_array, pg_text_array


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
                if purged:
                    conn.execute(
                        queries["forget_idle_counters"],
                        {
                            "key_names": pg_text_array([row.ordering_key for row in purged]),
                            "seqs": pg_int_array(row.seq for row in purged),
                        },
                    )
            total += len(purged)
            if len(purged) < batch:
                break
        removed.append(total)
    return removed[0], removed[1]
