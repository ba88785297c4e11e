"""``outbox-kafka purge``: the relay's retention, run now."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Engine

from outbox_kafka.database import storage_errors
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.naming import TableNames
from outbox_kafka.purging import purge_old_events
from outbox_kafka.relay.config import SECONDS_PER_DAY, RelaySettings
from outbox_kafka.schema.statements import queries_for

#: The relay's retention defaults, so ``purge`` and ``relay`` agree.
DEFAULT_RETAIN_DELIVERED_SECONDS: float = RelaySettings.retain_delivered_seconds
DEFAULT_RETAIN_DISCARDED_SECONDS: float = RelaySettings.retain_discarded_seconds
DEFAULT_PURGE_BATCH: int = RelaySettings.purge_batch


@dataclass(frozen=True)
class PurgeResult:
    dry_run: bool
    delivered: int
    discarded: int
    retain_delivered_seconds: float
    retain_discarded_seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "dry_run": self.dry_run,
            "delivered": self.delivered,
            "discarded": self.discarded,
            "retain_delivered_days": self.retain_delivered_seconds / SECONDS_PER_DAY,
            "retain_discarded_days": self.retain_discarded_seconds / SECONDS_PER_DAY,
        }


def purge(
    engine: Engine,
    names: TableNames | None = None,
    *,
    retain_delivered_seconds: float = DEFAULT_RETAIN_DELIVERED_SECONDS,
    retain_discarded_seconds: float = DEFAULT_RETAIN_DISCARDED_SECONDS,
    batch: int = DEFAULT_PURGE_BATCH,
    dry_run: bool = False,
) -> PurgeResult:
    """Delete delivered and discarded events older than their retention, now.

    The same statements as the relay's retention, ``batch`` rows per
    transaction, so a large purge never holds long locks. Pending events are
    never touched. With ``dry_run`` only counts what would go.
    """
    for what, value in (
        ("retain_delivered_seconds", retain_delivered_seconds),
        ("retain_discarded_seconds", retain_discarded_seconds),
    ):
        if value < 0:
            raise ConfigurationError(f"{what} must not be negative, got {value}")
    if batch <= 0:
        raise ConfigurationError(f"batch must be positive, got {batch}")
    q = queries_for(names or TableNames())
    if dry_run:
        with storage_errors("counting old events"), engine.connect() as conn:
            row = conn.execute(
                q["purge_counts"],
                {
                    "delivered_seconds": retain_delivered_seconds,
                    "discarded_seconds": retain_discarded_seconds,
                },
            ).one()
            conn.rollback()
        removed = {"purge_delivered": int(row.delivered), "purge_discarded": int(row.discarded)}
    else:
        with storage_errors("purging old events"):
            delivered, discarded = purge_old_events(
                engine,
                q,
                delivered_seconds=retain_delivered_seconds,
                discarded_seconds=retain_discarded_seconds,
                batch=batch,
            )
        removed = {"purge_delivered": delivered, "purge_discarded": discarded}
    return PurgeResult(
        dry_run=dry_run,
        delivered=removed["purge_delivered"],
        discarded=removed["purge_discarded"],
        retain_delivered_seconds=retain_delivered_seconds,
        retain_discarded_seconds=retain_discarded_seconds,
    )
