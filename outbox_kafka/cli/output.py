"""Plain-text renderings of the operator commands' results (their ``--json`` is ``as_dict()``)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from outbox_kafka.logs import redact
from outbox_kafka.operations import (
    CONSISTENCY_CHECKS,
    CheckResult,
    ConsistencyReport,
    DiscardedEvent,
    OutboxStats,
    ParkedKey,
    PurgeResult,
    RequeueResult,
    UnparkResult,
)
from outbox_kafka.relay.config import SECONDS_PER_DAY

#: Longer cells (error messages) are cut in tables; ``--json`` has them whole.
MAX_CELL = 72


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return stamp(value)
    text = " ".join(str(value).split())
    return text if len(text) <= MAX_CELL else text[: MAX_CELL - 1] + "…"


def table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell; numbers right-aligned."""
    cells = [[_cell(v) for v in row] for row in rows]
    numeric = [
        all(isinstance(row[i], int) or row[i] is None for row in rows) if rows else False
        for i in range(len(headers))
    ]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [
            v.rjust(w) if numeric[i] else v.ljust(w)
            for i, (v, w) in enumerate(zip(values, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return "\n".join([line(headers), *(line(r) for r in cells)])


def stamp(value: datetime) -> str:
    return value.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def age(seconds: float) -> str:
    """``0.4 s``, ``12.3 s``, ``4 min 05 s``, ``3 h 02 min``, ``2 d 05 h``."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    whole = int(seconds)
    minutes, secs = divmod(whole, 60)
    hours, minutes = divmod(minutes, 60)
    days, hours = divmod(hours, 24)
    if days:
        return f"{days} d {hours:02d} h"
    if hours:
        return f"{hours} h {minutes:02d} min"
    return f"{minutes} min {secs:02d} s"


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _events_table(events: Sequence[DiscardedEvent]) -> str:
    return table(
        ["event_id", "key", "seq", "topic", "type", "attempts", "created_at", "last_error"],
        [
            [e.event_id, e.key, e.seq, e.topic, e.type, e.attempts, e.created_at, e.last_error]
            for e in events
        ],
    )


def _parked_table(keys: Sequence[ParkedKey]) -> str:
    return table(
        ["key", "parked_at", "seq", "event_id", "type", "reason"],
        [
            [
                k.key,
                k.parked_at,
                k.next_seq,
                k.event.event_id if k.event else None,
                k.event.type if k.event else None,
                k.reason,
            ]
            for k in keys
        ],
    )


def stats_text(stats: OutboxStats) -> str:
    totals = stats.totals
    rows: list[list[object]] = [
        [t.topic, t.pending, t.delivered, t.discarded] for t in stats.topics
    ]
    rows.append(["(all topics)", totals.pending, totals.delivered, totals.discarded])
    out = [
        f"outbox {stats.table}",
        "",
        table(["topic", "pending", "delivered", "discarded"], rows),
    ]
    if not stats.delivered_counted:
        out.append("(delivered events not counted: --no-delivered)")
    oldest = stats.oldest_pending_age_seconds
    out += [
        "",
        "oldest pending event: " + ("none pending" if oldest is None else f"{age(oldest)} old"),
        f"keys: {stats.keys_queued} queued, {stats.keys_leased} leased by a relay, "
        f"{stats.parked_count} parked",
        "",
    ]
    if stats.parked_count:
        shown = len(stats.parked_keys)
        out.append(f"parked keys: {stats.parked_count} (longest parked first, {shown} shown)")
        if shown:
            out.append(_parked_table(stats.parked_keys))
    else:
        out.append("parked keys: none")
    out.append("")
    if stats.recent_discards:
        out.append(f"recent discards (newest first, {len(stats.recent_discards)} shown):")
        out.append(_events_table(stats.recent_discards))
    else:
        out.append("recent discards: none")
    return "\n".join(out)


def requeue_text(result: RequeueResult, *, show: int) -> str:
    if not result.events:
        return "nothing to requeue: no discarded event matches the selection"
    verb = "would requeue" if result.dry_run else "requeued"
    keys = result.keys
    out = [
        f"{verb} {_n(result.count, 'event')} on {_n(len(keys), 'key')} "
        "(in key order, sequence order per key)"
    ]
    if result.unparked_keys:
        out.append(
            f"{'would unpark' if result.dry_run else 'unparked'} "
            f"{_n(len(result.unparked_keys), 'key')}: {', '.join(result.unparked_keys)}"
        )
    if result.taken_keys:
        out.append(
            f"{_n(len(result.taken_keys), 'key')} held by a relay "
            f"({', '.join(result.taken_keys)}): "
            "its batch in flight for them goes out again after its lease"
        )
    out.append(_events_table(result.events[:show]))
    if result.count > show:
        out.append(f"... and {result.count - show} more (--list-limit N, or --json for all)")
    if result.dry_run:
        out.append("dry run: nothing was changed")
    return "\n".join(out)


def unpark_text(result: UnparkResult) -> str:
    if not result.keys:
        return "nothing to unpark: no parked key matches the selection"
    verb = "would unpark" if result.dry_run else "unparked"
    out = [
        f"{verb} {_n(result.count, 'key')}; the events that parked them stay discarded",
        _parked_table(result.keys),
    ]
    if result.dry_run:
        out.append("dry run: nothing was changed")
    return "\n".join(out)


def purge_text(result: PurgeResult) -> str:
    verb = "would delete" if result.dry_run else "deleted"
    days_delivered = result.retain_delivered_seconds / SECONDS_PER_DAY
    days_discarded = result.retain_discarded_seconds / SECONDS_PER_DAY
    return (
        f"{verb} {result.delivered} delivered events older than {days_delivered:g} days "
        f"and {result.discarded} discarded events older than {days_discarded:g} days"
        + ("\ndry run: nothing was changed" if result.dry_run else "")
    )


def check_text(results: Sequence[CheckResult], consistency: ConsistencyReport | None = None) -> str:
    """One OK/FAIL line per check, names padded so the details line up; with
    ``consistency``, its line last and then each violation."""
    rows = [(r.ok, r.name, r.detail) for r in results]
    if consistency is not None:
        rows.append((consistency.ok, "consistency", _consistency_detail(consistency)))
    width = max((len(name) for _, name, _ in rows), default=0)
    lines = [
        f"{'OK  ' if ok else 'FAIL'} {name.ljust(width)}  {detail}" for ok, name, detail in rows
    ]
    if consistency is not None:
        lines += _violation_lines(consistency)
    return "\n".join(lines)


def _consistency_detail(report: ConsistencyReport) -> str:
    if report.ok:
        return f"{report.table}: no violations ({', '.join(CONSISTENCY_CHECKS)})"
    return f"{report.table}: {_n(len(report.violations), 'violation')}"


def _violation_lines(report: ConsistencyReport) -> list[str]:
    lines = []
    for v in report.violations:
        event = f" event {v.event_id}" if v.event_id else ""
        lines.append(f"     {v.check}: key {v.key!r}{event}: {v.detail}")
    for check, more in sorted(report.truncated.items()):
        if more:
            lines.append(f"     {check}: more than listed (raise --violation-limit)")
    return lines


def emit(args: argparse.Namespace, document: dict[str, Any], text: str) -> None:
    """Print the result: ``document`` as JSON with ``--json``, else ``text``; secrets masked."""
    out = json.dumps(document, indent=2, ensure_ascii=False) if args.json else text
    print(redact(out))
