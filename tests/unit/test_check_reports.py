"""The plain-text report of ``outbox-kafka check --consistency``."""

from __future__ import annotations

import pytest

from outbox_kafka.cli.output import check_text
from outbox_kafka.operations import CheckResult, ConsistencyReport, Violation

CHECKS = [
    CheckResult(
        "database", True, "postgresql://relay:***@db/app (PostgreSQL 15.19, connected as relay)"
    ),
    CheckResult("migrations", True, "public.outbox is at version 5 (current)"),
]


def _violation(key: str) -> Violation:
    return Violation("unqueued_pending", key, "0193-e", "its key has no queue row")


def _report(count: int) -> ConsistencyReport:
    violations = [_violation(f"k-{n}") for n in range(count)]
    return ConsistencyReport("public.outbox", violations, {"unqueued_pending": False})


@pytest.mark.parametrize(
    ("count", "summary"),
    [(0, "no violations"), (1, "1 violation"), (2, "2 violations")],
)
def test_the_consistency_line_counts_violations_in_good_english(count: int, summary: str) -> None:
    consistency_line = check_text(CHECKS, _report(count)).splitlines()[2]
    assert consistency_line.startswith("OK " if count == 0 else "FAIL ")
    assert consistency_line.split(": ", 1)[1].startswith(summary)
    assert f"{summary}s" not in consistency_line


@pytest.mark.parametrize("count", [0, 1])
def test_the_consistency_line_lines_up_with_the_database_checks(count: int) -> None:
    lines = check_text(CHECKS, _report(count)).splitlines()
    details = [
        line.index(d)
        for line, d in zip(lines[:3], ["postgresql:", "public.", "public."], strict=True)
    ]
    assert len(set(details)) == 1, "\n".join(lines)
    names = [
        line.index(n)
        for line, n in zip(lines[:3], ["database", "migrations", "consistency"], strict=True)
    ]
    assert len(set(names)) == 1, "\n".join(lines)


def test_violations_follow_the_consistency_line() -> None:
    lines = check_text(CHECKS, _report(1)).splitlines()
    assert lines[3] == "     unqueued_pending: key 'k-0' event 0193-e: its key has no queue row"
    assert len(lines) == 4


def test_without_a_consistency_report_only_the_checks_are_listed() -> None:
    assert check_text(CHECKS).splitlines() == [
        "OK   database    postgresql://relay:***@db/app (PostgreSQL 15.19, connected as relay)",
        "OK   migrations  public.outbox is at version 5 (current)",
    ]
