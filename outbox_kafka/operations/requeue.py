"""``outbox-kafka requeue`` and ``unpark``: discarded events and parked keys set going again."""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import InvalidSelection, StorageError
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.statements import pg_array, queries_for

from .events import DiscardedEvent, ParkedKey
from .selection import Selection


@dataclass(frozen=True)
class RequeueResult:
    """What a requeue did, or with ``dry_run`` would do."""

    dry_run: bool
    events: list[DiscardedEvent]
    #: Keys that were (would be) parked and flow again.
    unparked_keys: list[str] = field(default_factory=list)
    #: Keys a relay held: its batch in flight for them is sent again after its lease.
    taken_keys: list[str] = field(default_factory=list)

    @property
    def count(self) -> int:
        return len(self.events)

    @property
    def keys(self) -> list[str]:
        return sorted({e.key for e in self.events})

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "count": self.count,
            "keys": self.keys,
            "unparked_keys": self.unparked_keys,
            "taken_from_relay_keys": self.taken_keys,
            "events": [e.as_dict() for e in self.events],
        }


@dataclass(frozen=True)
class UnparkResult:
    dry_run: bool
    keys: list[ParkedKey]

    @property
    def count(self) -> int:
        return len(self.keys)

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "count": self.count,
            "keys": [k.as_dict() for k in self.keys],
        }


def requeue(
    engine: Engine,
    selection: Selection,
    names: TableNames | None = None,
    *,
    dry_run: bool = False,
) -> RequeueResult:
    """Make the selected discarded events pending again, in key order.

    Each key resumes from its earliest requeued event, so per key the
    requeued events go out in sequence order, before any later event of the
    key that is still pending. A parked key is unparked, but only together
    with the event that parked it: a selection holding other events of a
    parked key and not that one is refused (:class:`InvalidSelection`), so a
    requeue never silently skips a parked event. A key a relay is working on
    is taken back from it; that relay's batch for the key is sent again once
    its lease ends (a duplicate the consumer removes by its event id). With
    ``dry_run`` nothing changes and the result says what would be done.
    """
    selection.require("discarded events")
    q = queries_for(names or TableNames())
    with storage_errors("requeueing events"), engine.connect() as conn, conn.begin() as tx:
        events = [
            DiscardedEvent.from_row(r)
            for r in conn.execute(q["requeue_candidates"], selection.params())
        ]
        chosen = {e.event_id for e in events}
        keys = sorted({e.key for e in events})
        unparked: list[str] = []
        taken: list[str] = []
        blocked: list[str] = []
        if keys:
            # Lock first, then read: see lock_keys in queries.sql.
            conn.execute(q["requeue_queue_rows"], {"event_ids": pg_array(sorted(chosen))})
            conn.execute(q["lock_keys"], {"ordering_keys": pg_array(keys)})
            states = conn.execute(q["requeue_key_states"], {"ordering_keys": pg_array(keys)})
            for state in states:
                if state.leased:
                    taken.append(state.ordering_key)
                if state.parked_at is None:
                    continue
                if state.parked_by is not None and state.parked_by not in chosen:
                    blocked.append(f"{state.ordering_key!r} (parked by event {state.parked_by})")
                else:
                    unparked.append(state.ordering_key)
        if blocked:
            raise InvalidSelection(
                "the selection holds events of parked keys but not the event that parked "
                f"them: {', '.join(blocked)}; select that event too, or unpark the key "
                "first (outbox-kafka unpark) to go on without it"
            )
        if dry_run or not events:
            tx.rollback()
        else:
            done = conn.execute(q["requeue_events"], {"event_ids": pg_array(sorted(chosen))}).one()
            if int(done.requeued) != len(events):  # the candidates are locked: cannot happen
                raise StorageError(
                    f"requeue changed {done.requeued} events instead of {len(events)}; rolled back"
                )
    return RequeueResult(dry_run=dry_run, events=events, unparked_keys=unparked, taken_keys=taken)


def requeue_events(
    engine: Engine, event_ids: Iterable[uuid.UUID | str], names: TableNames | None = None
) -> int:
    """Make these discarded events pending again (see :func:`requeue`); return how many.

    Ids of events that are not discarded are ignored.
    """
    ids = tuple(str(i) for i in event_ids)
    if not ids:
        return 0
    return requeue(engine, Selection(event_ids=ids), names).count


def unpark(
    engine: Engine,
    selection: Selection,
    names: TableNames | None = None,
    *,
    dry_run: bool = False,
) -> UnparkResult:
    """Let the selected parked keys continue with their later events.

    The event that parked each key stays discarded (it can still be
    requeued later, out of order). ``selection.keys`` matches the key; the
    other selectors match the event that parked it.
    """
    selection.require("parked keys")
    q = queries_for(names or TableNames())
    with storage_errors("unparking keys"), engine.connect() as conn, conn.begin() as tx:
        # Lock first, then read (see lock_keys in queries.sql); only the keys locked.
        params = selection.params()
        locked = list(
            conn.execute(
                q["lock_parked_keys"], {"ordering_keys": params["ordering_keys"]}
            ).scalars()
        )
        parked: list[ParkedKey] = []
        if locked:
            read = {**params, "ordering_keys": pg_array(locked)}
            parked = [ParkedKey.from_row(r) for r in conn.execute(q["unpark_candidates"], read)]
        if dry_run or not parked:
            tx.rollback()
        else:
            conn.execute(q["unpark_keys"], {"ordering_keys": pg_array([k.key for k in parked])})
    return UnparkResult(dry_run=dry_run, keys=parked)


def unpark_keys(engine: Engine, keys: Iterable[str], names: TableNames | None = None) -> int:
    """Let parked keys continue with their later events, leaving the discarded ones as they are."""
    wanted = tuple(keys)
    if not wanted:
        return 0
    return unpark(engine, Selection(keys=wanted), names).count
