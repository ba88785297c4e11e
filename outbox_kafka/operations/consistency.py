"""``outbox-kafka check --consistency``: the invariants the relay relies on."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.naming import TableNames
from outbox_kafka.schema.statements import queries_for

#: The invariant checks of :func:`check_consistency`, by name, each with its statement.
CONSISTENCY_CHECKS: dict[str, str] = {
    "unqueued_pending": "consistency_unqueued_pending",
    "passed_pending": "consistency_passed_pending",
    "counter_behind": "consistency_counter_behind",
    "queue_rows": "consistency_queue_rows",
    "discarded_without_reason": "consistency_discarded_without_reason",
}


@dataclass(frozen=True)
class Violation:
    """One broken invariant: which check, on which key and event, and how."""

    check: str
    key: str
    event_id: str | None
    detail: str

    def as_dict(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "key": self.key,
            "event_id": self.event_id,
            "detail": self.detail,
        }


@dataclass(frozen=True)
class ConsistencyReport:
    """What :func:`check_consistency` found, read from one snapshot."""

    table: str
    violations: list[Violation]
    #: Per check: whether it found more than the limit it listed.
    truncated: dict[str, bool]

    @property
    def ok(self) -> bool:
        return not self.violations

    def as_dict(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "ok": self.ok,
            "checks": list(CONSISTENCY_CHECKS),
            "violations": [v.as_dict() for v in self.violations],
            "truncated": sorted(name for name, more in self.truncated.items() if more),
        }


def check_consistency(
    engine: Engine, names: TableNames | None = None, *, limit: int = 100
) -> ConsistencyReport:
    """Check the invariants the relay relies on, on a live outbox, from one snapshot.

    Every pending event is reachable by the key queue (its key has a queue
    row whose ``next_seq`` is at or below it); every key's counter is at or
    above the sequence number of each of its pending and discarded events;
    every queue row has a counter, a ``next_seq`` at most one past it, a
    lease that is either wholly set or wholly clear, and, when parked, a next
    event that is not pending; every discarded event has a reason. Each check
    lists at most ``limit`` violations. Reads only; safe while relays,
    writers and operators work (it reads pending and discarded events through
    their partial indexes, and the whole key queue).
    """
    if limit <= 0:
        raise ConfigurationError(f"limit must be positive, got {limit}")
    names = names or TableNames()
    q = queries_for(names)
    violations: list[Violation] = []
    truncated: dict[str, bool] = {}
    with storage_errors("checking consistency"), engine.connect() as conn:
        conn = conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        with conn.begin():
            for check, statement in CONSISTENCY_CHECKS.items():
                found = conn.execute(q[statement], {"limit": limit + 1}).all()
                truncated[check] = len(found) > limit
                violations.extend(
                    Violation(check, row.ordering_key, row.event_id, row.detail)
                    for row in found[:limit]
                )
    return ConsistencyReport(names.qualified_events, violations, truncated)
