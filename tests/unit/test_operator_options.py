"""The operator commands' options, parsed in process (no services)."""

from __future__ import annotations

import os
from datetime import UTC, datetime, timedelta, timezone

import pytest

from outbox_kafka.cli import build_parser
from outbox_kafka.cli.output import age, table
from outbox_kafka.errors import InvalidSelection
from outbox_kafka.operations import Selection


@pytest.fixture(autouse=True)
def _no_outbox_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("OUTBOX_"):
            monkeypatch.delenv(name)


def test_purge_retention_defaults_are_the_relays() -> None:
    relay = build_parser().parse_args(["relay"])
    purge = build_parser().parse_args(["purge"])
    assert (purge.retain_delivered_days, purge.retain_discarded_days) == (
        relay.retain_delivered_days,
        relay.retain_discarded_days,
    )
    assert purge.purge_batch > 0


def test_check_takes_every_relay_setting() -> None:
    relay = vars(build_parser().parse_args(["relay"]))
    check = vars(build_parser().parse_args(["check"]))
    assert set(relay) - {"handler"} <= set(check)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2026-03-01", datetime(2026, 3, 1, tzinfo=UTC)),
        ("2026-03-01T12:30:00Z", datetime(2026, 3, 1, 12, 30, tzinfo=UTC)),
        ("2026-03-01T12:30", datetime(2026, 3, 1, 12, 30, tzinfo=UTC)),
        (
            "2026-03-01T14:30:00+02:00",
            datetime(2026, 3, 1, 14, 30, tzinfo=timezone(timedelta(hours=2))),
        ),
    ],
)
def test_times_are_iso_8601_and_utc_without_an_offset(text: str, expected: datetime) -> None:
    args = build_parser().parse_args(["requeue", "--since", text])
    assert args.since == expected
    assert args.since.utcoffset() is not None


def test_selectors_are_repeatable_and_never_read_from_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OUTBOX_KEY", "k9")
    monkeypatch.setenv("OUTBOX_ALL", "1")
    args = build_parser().parse_args(
        ["requeue", "--key", "a", "--key", "b", "--type", "t1", "--type", "t2", "--topic", "x"]
    )
    assert (args.key, args.types, args.topics, args.everything) == (
        ["a", "b"],
        ["t1", "t2"],
        ["x"],
        False,
    )
    assert build_parser().parse_args(["unpark"]).key == []


def test_selection_normalises_event_ids() -> None:
    raw = "0193A2B4-0000-7000-8000-000000000001"
    assert Selection(event_ids=(raw,)).event_ids == (raw.lower(),)
    assert Selection().is_empty and not Selection(keys=("k",)).is_empty
    with pytest.raises(InvalidSelection):
        Selection().require("events")
    Selection(everything=True).require("events")


def test_tables_and_ages_read_well() -> None:
    rendered = table(["name", "n"], [["a", 1], ["long name", 1234], ["c", None]])
    assert rendered.splitlines() == [
        "name          n",
        "a             1",
        "long name  1234",
        "c             -",
    ]
    assert table(["error"], [["x" * 500]]).splitlines()[1].endswith("…")
    assert [age(s) for s in (0.42, 75, 3 * 3600 + 120, 2 * 86400 + 5 * 3600)] == [
        "0.4 s",
        "1 min 15 s",
        "3 h 02 min",
        "2 d 05 h",
    ]
