"""The reliability table: one row per scenario, printed at the end of the session."""

from __future__ import annotations

import os
from dataclasses import dataclass

#: ``OUTBOX_RELIABILITY=long`` (set by ``make chaos``) runs every scenario at full size.
LONG = os.environ.get("OUTBOX_RELIABILITY", "").strip().lower() == "long"


def size(short: int, long: int) -> int:
    """A scenario parameter: ``short`` in the normal suite, ``long`` under ``make chaos``."""
    return long if LONG else short


def seconds(short: float, long: float) -> float:
    return long if LONG else short


@dataclass(frozen=True)
class Row:
    scenario: str
    enqueued: int
    delivered: int
    lost: int
    duplicated: int
    order_violations: int
    #: Seconds from the end of the (slowest-to-heal) fault until every event
    #: written before that moment was delivered; None where no fault ends.
    recover_seconds: float | None
    note: str = ""


ROWS: list[Row] = []

HEADER = (
    "| scenario | enqueued | delivered | lost | duplicated | order violations "
    "| time to recover | notes |"
)
RULE = "|---|---:|---:|---:|---:|---:|---:|---|"


def record(row: Row) -> Row:
    ROWS.append(row)
    return row


def markdown(rows: list[Row]) -> str:
    lines = [HEADER, RULE]
    for r in rows:
        recover = "—" if r.recover_seconds is None else f"{r.recover_seconds:.1f} s"
        lines.append(
            f"| {r.scenario} | {r.enqueued:,} | {r.delivered:,} | {r.lost:,} | "
            f"{r.duplicated:,} | {r.order_violations:,} | {recover} | {r.note} |"
        )
    return "\n".join(lines)
