"""Operator actions on an outbox: send discarded events again, let parked keys flow.

These run in their own short transactions; the relay picks the result up on
its next claim.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from sqlalchemy import Engine

from .naming import TableNames
from .queries import pg_array, queries_for


def requeue_events(
    engine: Engine, event_ids: Iterable[uuid.UUID | str], names: TableNames | None = None
) -> int:
    """Make discarded events pending again; their keys resume from the earliest of them.

    Returns how many events were requeued (ids that are not discarded are
    ignored). A parked key is unparked, and the requeued event goes out before
    any later event of its key that is still pending.
    """
    q = queries_for(names or TableNames())
    ids = pg_array([str(i) for i in event_ids])
    with engine.begin() as conn:
        row = conn.execute(q["requeue_events"], {"event_ids": ids}).one()
    return int(row.requeued)


def unpark_keys(engine: Engine, keys: Iterable[str], names: TableNames | None = None) -> int:
    """Let parked keys continue with their later events, leaving the discarded ones as they are."""
    q = queries_for(names or TableNames())
    with engine.begin() as conn:
        result = conn.execute(q["unpark_keys"], {"ordering_keys": pg_array(list(keys))})
    return int(result.rowcount)
