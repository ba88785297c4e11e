"""``outbox-kafka stats | requeue | unpark | purge | check`` run as separate processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from sqlalchemy.engine import make_url

from outbox_kafka import Event
from outbox_kafka.demo.embedded import EmbeddedBroker, free_port
from tests.operator_support import (
    build_mix,
    corrupt,
    counts_by_topic,
    drain,
    restore,
    snapshot,
)
from tests.relay_support import (
    TcpProxy,
    admit_arrivals,
    consume_all,
    enqueue_bulk,
    per_key_order,
    rows,
    scalar,
    seq_events,
    topic_outbox,
)
from tests.support import libpq_url

REPO = Path(__file__).resolve().parent.parent.parent
CLI = [sys.executable, "-m", "outbox_kafka.cli"]
SECRET = "s3cr3t-pw-9q"
RELAY_TIMING = ["--lease-seconds", "5", "--delivery-timeout-ms", "3000"]


def run_cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    base["COLUMNS"] = "200"
    base.update(env)
    return subprocess.run(
        [*CLI, *args], capture_output=True, text=True, env=base, timeout=120, cwd=REPO, check=False
    )


def ok(*args: str, **env: str) -> str:
    result = run_cli(*args, **env)
    assert result.returncode == 0, result.stderr + result.stdout
    assert "Traceback" not in result.stderr
    return result.stdout


def as_json(*args: str, **env: str) -> Any:
    return json.loads(ok(*args, "--json", **env))


@pytest.fixture
def url(database_url: str) -> str:
    """The test database as a libpq URL with a password in it (the test server trusts it)."""
    parsed = make_url(database_url)
    if not parsed.password:
        parsed = parsed.set(password=SECRET)
    return libpq_url(parsed.render_as_string(hide_password=False))


def secret_of(url: str) -> str:
    password = make_url(url).password
    assert password
    return str(password)


# --------------------------------------------------------------------------- stats


def test_stats_json_and_table_match_the_outbox(
    url: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    mix = build_mix(engine, database_url, kafka_bootstrap, new_topic)
    doc = as_json("stats", "--database-url", url)
    truth = counts_by_topic(engine)

    assert set(doc) == {
        "table",
        "totals",
        "topics",
        "oldest_pending_age_seconds",
        "keys",
        "parked_keys",
        "recent_discards",
    }
    assert doc["table"] == "public.outbox"
    assert doc["topics"] == [
        {
            "topic": topic,
            "pending": truth[topic].get("pending", 0),
            "delivered": truth[topic].get("delivered", 0),
            "discarded": truth[topic].get("discarded", 0),
        }
        for topic in sorted(truth)
    ]
    by_status = {
        status: int(n)
        for status, n in rows(engine, "SELECT status, count(*) FROM outbox GROUP BY status")
    }
    assert doc["totals"] == by_status == {"pending": 9, "delivered": 9, "discarded": 2}
    oldest = scalar(
        engine,
        "SELECT EXTRACT(EPOCH FROM now() - min(created_at)) FROM outbox WHERE status = 'pending'",
    )
    assert 0 < doc["oldest_pending_age_seconds"] <= float(oldest)
    assert doc["keys"] == {
        "queued": scalar(
            engine,
            "SELECT count(*) FROM (SELECT ordering_key FROM outbox_keys "
            "UNION SELECT ordering_key FROM outbox_arrivals) q",
        ),
        "leased": 0,
    }
    error = scalar(
        engine, "SELECT last_error FROM outbox WHERE event_id = :id", id=mix.parking_event
    )
    parked_at = scalar(engine, "SELECT parked_at FROM outbox_keys WHERE ordering_key = 'P'")
    assert doc["parked_keys"] == {
        "count": 1,
        "keys": [
            {
                "key": "P",
                "next_seq": 2,
                "parked_at": parked_at.astimezone(UTC).isoformat(),
                "event_id": mix.parking_event,
                "topic": mix.parked,
                "type": "p.e",
                "reason": error,
            }
        ],
    }
    discards = rows(
        engine,
        "SELECT CAST(event_id AS text), ordering_key, seq, topic, type, attempts, last_error, "
        "created_at FROM outbox WHERE status = 'discarded' ORDER BY created_at DESC",
    )
    assert doc["recent_discards"] == [
        {
            "event_id": r[0],
            "key": r[1],
            "seq": r[2],
            "topic": r[3],
            "type": r[4],
            "attempts": r[5],
            "last_error": r[6],
            "created_at": r[7].astimezone(UTC).isoformat(),
        }
        for r in discards
    ]

    text = ok("stats", OUTBOX_DATABASE_URL=url)
    assert "pending  delivered  discarded" in text
    busy = next(line for line in text.splitlines() if line.startswith(mix.busy))
    assert busy.split()[1:] == ["5", "8", "1"]
    assert "(all topics)" in text and "parked keys: 1" in text
    assert mix.parking_event in text and mix.continue_discard in text
    assert SECRET not in text

    quick = as_json("stats", "--no-delivered", "--parked-limit", "0", OUTBOX_DATABASE_URL=url)
    assert quick["totals"] == {"pending": 9, "delivered": None, "discarded": 2}
    assert quick["parked_keys"] == {"count": 1, "keys": []}


# --------------------------------------------------------------------------- requeue / unpark


def test_requeue_dry_run_then_requeue_sends_the_parked_key_in_order(
    url: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    mix = build_mix(engine, database_url, kafka_bootstrap, new_topic)
    restore(engine, mix.parking_event, mix.parking_value)
    before = snapshot(engine)

    text = ok("requeue", "--key", "P", "--dry-run", OUTBOX_DATABASE_URL=url)
    assert "would requeue 1 event on 1 key" in text
    assert "would unpark 1 key: P" in text
    assert mix.parking_event in text and "INVALID_ENVELOPE" in text
    assert "dry run: nothing was changed" in text
    planned = as_json("requeue", "--key", "P", "--dry-run", OUTBOX_DATABASE_URL=url)
    assert (planned["dry_run"], planned["count"]) == (True, 1)
    assert snapshot(engine) == before

    done = as_json("requeue", "--key", "P", OUTBOX_DATABASE_URL=url)
    assert done["dry_run"] is False
    assert [e["event_id"] for e in done["events"]] == [mix.parking_event]
    assert (done["keys"], done["unparked_keys"], done["taken_from_relay_keys"]) == (
        ["P"],
        ["P"],
        [],
    )

    drained = ok(
        "relay",
        "--drain",
        "--on-exhausted",
        "park",
        "--bootstrap-servers",
        kafka_bootstrap,
        *RELAY_TIMING,
        OUTBOX_DATABASE_URL=url,
    )
    assert "drained: 10 delivered, 0 discarded" in drained
    records = consume_all(kafka_bootstrap, mix.parked, 6)
    assert per_key_order(records) == {"P": mix.ids["P"]}  # the requeued event first, then the rest


def _discarded(engine: sa.Engine, database_url: str, bootstrap: str, topic: str) -> list[str]:
    """Twelve discarded events: keys k0..k2, types a.made/b.made, event i written i days ago."""
    ids = enqueue_bulk(
        engine,
        topic_outbox(),
        [
            Event(type=("a.made", "b.made")[i % 2], key=f"k{i % 3}", topic=topic, data={"i": i})
            for i in range(12)
        ],
    )
    for event_id in ids:
        corrupt(engine, event_id)
    discarded = 0
    for _ in range(12):  # a drain ends after a cycle that only discarded: run it again
        discarded += drain(database_url, bootstrap).discarded
        if discarded == 12:
            break
    assert discarded == 12
    now = datetime.now(UTC).replace(microsecond=0)
    with engine.begin() as conn:
        for i, event_id in enumerate(ids):
            conn.execute(
                sa.text("UPDATE outbox SET created_at = :t WHERE event_id = :id"),
                {"t": now - timedelta(days=i), "id": event_id},
            )
    return ids


def test_requeue_selectors_by_key_type_and_time(
    url: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    ids = _discarded(engine, database_url, kafka_bootstrap, new_topic(1))
    truth = rows(
        engine,
        "SELECT CAST(event_id AS text) AS id, ordering_key AS key, type, created_at "
        "FROM outbox ORDER BY ordering_key, seq",
    )
    since = datetime.now(UTC) - timedelta(days=8, hours=12)
    until = datetime.now(UTC) - timedelta(days=2, hours=12)
    cases: list[tuple[list[str], Callable[[Any], bool]]] = [
        (["--key", "k1"], lambda r: r.key == "k1"),
        (["--key", "k0", "--key", "k2"], lambda r: r.key in ("k0", "k2")),
        (["--type", "b.made"], lambda r: r.type == "b.made"),
        (["--since", since.isoformat()], lambda r: r.created_at >= since),
        (["--until", until.strftime("%Y-%m-%dT%H:%M:%S")], lambda r: r.created_at < until),
        (
            ["--since", since.isoformat(), "--until", until.isoformat(), "--type", "a.made"],
            lambda r: since <= r.created_at < until and r.type == "a.made",
        ),
        (["--event-id", ids[5], "--event-id", ids[1]], lambda r: r.id in (ids[1], ids[5])),
        (["--all"], lambda r: True),
    ]
    before = snapshot(engine)
    for flags, keep in cases:
        wanted = [r.id for r in truth if keep(r)]
        assert wanted, flags
        planned = as_json("requeue", *flags, "--dry-run", OUTBOX_DATABASE_URL=url)
        assert [e["event_id"] for e in planned["events"]] == wanted, flags
        assert planned["count"] == len(wanted)
    assert snapshot(engine) == before

    done = as_json("requeue", "--type", "a.made", "--key", "k2", OUTBOX_DATABASE_URL=url)
    wanted = {r.id for r in truth if r.type == "a.made" and r.key == "k2"}
    assert {e["event_id"] for e in done["events"]} == wanted
    pending = rows(engine, "SELECT CAST(event_id AS text) FROM outbox WHERE status = 'pending'")
    assert {r[0] for r in pending} == wanted


def test_an_empty_or_contradictory_selection_is_refused(
    url: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    _discarded(engine, database_url, kafka_bootstrap, new_topic(1))
    before = snapshot(engine)
    for args, message in [
        (["requeue"], "nothing selected"),
        (["requeue", "--dry-run"], "nothing selected"),
        (["unpark"], "nothing selected"),
        (["requeue", "--all", "--key", "k1"], "cannot be combined with selectors"),
        (["requeue", "--event-id", "not-a-uuid"], "not a UUID"),
        (["requeue", "--since", "yesterday"], "not an ISO-8601 time"),
        (["requeue", "--since", "2030-01-02", "--until", "2030-01-01"], "empty time range"),
    ]:
        result = run_cli(*args, OUTBOX_DATABASE_URL=url)
        assert result.returncode == 2, (args, result.stdout)
        assert message in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
        assert result.stdout == ""
    # Selectors never come from the environment.
    result = run_cli("requeue", OUTBOX_DATABASE_URL=url, OUTBOX_ALL="1", OUTBOX_KEY="k1")
    assert result.returncode == 2 and "nothing selected" in result.stderr
    assert snapshot(engine) == before


def test_unpark_skips_the_event_that_parked_the_key(
    url: str,
    engine: sa.Engine,
    database_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    mix = build_mix(engine, database_url, kafka_bootstrap, new_topic)
    before = snapshot(engine)
    text = ok("unpark", "--key", "P", "--dry-run", OUTBOX_DATABASE_URL=url)
    assert "would unpark 1 key" in text and mix.parking_event in text
    assert snapshot(engine) == before

    done = as_json("unpark", "--all", OUTBOX_DATABASE_URL=url)
    assert [(k["key"], k["event_id"]) for k in done["keys"]] == [("P", mix.parking_event)]
    assert as_json("unpark", "--all", OUTBOX_DATABASE_URL=url)["count"] == 0
    drain(database_url, kafka_bootstrap, on_exhausted="park")
    records = consume_all(kafka_bootstrap, mix.parked, 5)
    assert per_key_order(records) == {"P": [i for i in mix.ids["P"] if i != mix.parking_event]}


# --------------------------------------------------------------------------- purge

AGE = sa.text(
    "UPDATE outbox SET status = :status, delivered_at = CASE WHEN :status = 'delivered' "
    "THEN now() - make_interval(days => :days) END, "
    "created_at = now() - make_interval(days => :days) WHERE event_id = ANY(CAST(:ids AS uuid[]))"
)


def test_purge_counts_then_removes_only_old_rows(url: str, engine: sa.Engine) -> None:
    ids = enqueue_bulk(
        engine,
        topic_outbox(),
        [Event(type="t", key=f"k{i % 4}", topic="t", data={"i": i}) for i in range(60)],
    )
    with engine.begin() as conn:
        for status, days, chunk in [
            ("delivered", 8, ids[0:20]),
            ("delivered", 3, ids[20:30]),
            ("discarded", 100, ids[30:40]),
            ("discarded", 10, ids[40:50]),
            ("pending", 365, ids[50:60]),
        ]:
            conn.execute(AGE, {"status": status, "days": days, "ids": chunk})
    before = snapshot(engine)

    counted = as_json("purge", "--dry-run", OUTBOX_DATABASE_URL=url)
    assert counted == {
        "dry_run": True,
        "delivered": 20,
        "discarded": 10,
        "retain_delivered_days": 7.0,
        "retain_discarded_days": 90.0,
    }
    assert "would delete 20 delivered" in ok("purge", "--dry-run", OUTBOX_DATABASE_URL=url)
    assert snapshot(engine) == before

    text = ok("purge", "--purge-batch", "3", OUTBOX_DATABASE_URL=url)
    assert "deleted 20 delivered events older than 7 days and 10 discarded" in text
    done = as_json(
        "purge",
        "--retain-delivered-days",
        "2",
        OUTBOX_DATABASE_URL=url,
        OUTBOX_RETAIN_DISCARDED_DAYS="9.5",
    )
    assert (done["delivered"], done["discarded"], done["retain_discarded_days"]) == (10, 10, 9.5)
    left = {r[0] for r in rows(engine, "SELECT CAST(event_id AS text) FROM outbox")}
    assert left == set(ids[50:60])

    result = run_cli("purge", "--retain-delivered-days", "-1", OUTBOX_DATABASE_URL=url)
    assert result.returncode == 2 and "must not be negative" in result.stderr


# --------------------------------------------------------------------------- check


def _check(*args: str, **env: str) -> tuple[int, dict[str, tuple[bool, str]], str]:
    result = run_cli("check", "--check-timeout", "3", *args, **env)
    assert "Traceback" not in result.stderr, result.stderr
    doc = json.loads(run_cli("check", "--check-timeout", "3", "--json", *args, **env).stdout)
    lines = {c["name"]: (c["ok"], c["detail"]) for c in doc["checks"]}
    assert doc["ok"] == (result.returncode == 0) == all(v[0] for v in lines.values())
    return result.returncode, lines, result.stdout + result.stderr


def test_check_passes_on_a_good_set_up(url: str, kafka_bootstrap: str) -> None:
    code, lines, text = _check(
        "--bootstrap-servers",
        kafka_bootstrap,
        "--schema-dir",
        str(REPO / "schemas" / "events"),
        OUTBOX_DATABASE_URL=url,
    )
    assert code == 0, text
    assert list(lines) == ["settings", "schemas", "database", "migrations", "kafka", "message size"]
    assert all(line.startswith("OK ") for line in text.strip().splitlines()), text
    assert "3 event types" in lines["schemas"][1]
    assert "version 8 (current)" in lines["migrations"][1]
    assert kafka_bootstrap in lines["kafka"][1]
    assert SECRET not in text and "***" in lines["database"][1]


def test_check_consistency_passes_then_fails_on_a_doctored_table(
    url: str, engine: sa.Engine, new_topic: Callable[..., str]
) -> None:
    ids = enqueue_bulk(engine, topic_outbox(), seq_events(new_topic(1), ["a", "b"], 4))
    admit_arrivals(engine)
    code, lines, text = _check("--consistency", OUTBOX_DATABASE_URL=url)
    assert code == 0, text
    assert list(lines) == ["database", "migrations"]
    assert "OK   consistency" in text and "no violations" in text

    with engine.begin() as conn:
        conn.execute(sa.text("DELETE FROM outbox_keys WHERE ordering_key = 'a'"))
    result = run_cli("check", "--consistency", OUTBOX_DATABASE_URL=url)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "FAIL consistency" in result.stdout and "2 violations" in result.stdout
    for event_id in (ids[0], ids[2]):  # key a's two events
        assert f"unqueued_pending: key 'a' event {event_id}" in result.stdout
    doc = json.loads(run_cli("check", "--consistency", "--json", OUTBOX_DATABASE_URL=url).stdout)
    assert doc["ok"] is False
    assert {(v["check"], v["key"]) for v in doc["consistency"]["violations"]} == {
        ("unqueued_pending", "a")
    }


def test_check_fails_on_an_unmigrated_database(
    empty_database: Callable[[], str], kafka_bootstrap: str
) -> None:
    code, lines, text = _check(
        "--bootstrap-servers", kafka_bootstrap, "--database-url", libpq_url(empty_database())
    )
    assert code == 1
    assert lines["database"][0] and not lines["migrations"][0]
    assert "not migrated" in lines["migrations"][1]
    assert "run outbox-kafka migrate" in lines["migrations"][1]
    assert "FAIL migrations" in text


def test_check_fails_on_an_unreachable_broker(url: str) -> None:
    code, lines, text = _check(
        "--bootstrap-servers", f"127.0.0.1:{free_port()}", OUTBOX_DATABASE_URL=url
    )
    assert code == 1
    assert lines["database"][0] and lines["migrations"][0]
    assert not lines["kafka"][0]
    assert "no metadata from 127.0.0.1" in lines["kafka"][1]
    assert "FAIL kafka" in text


def test_check_fails_on_a_bad_setting(url: str, kafka_bootstrap: str) -> None:
    code, lines, text = _check(
        "--bootstrap-servers",
        kafka_bootstrap,
        "--lease-seconds",
        "5",
        "--delivery-timeout-ms",
        "4500",
        OUTBOX_DATABASE_URL=url,
    )
    assert code == 1
    assert not lines["settings"][0]
    assert "must be at most 80% of the lease" in lines["settings"][1]
    assert lines["database"][0], "the database is still checked"
    assert "FAIL settings" in text


def test_check_fails_on_a_missing_dead_letter_topic_and_a_bad_schema_dir(
    url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    (tmp_path / "broken.json").write_text("{not json", encoding="utf-8")
    code, lines, _ = _check(
        "--bootstrap-servers",
        kafka_bootstrap,
        "--dead-letter-topic",
        "no-such-dlt-topic",
        "--schema-dir",
        str(tmp_path),
        OUTBOX_DATABASE_URL=url,
    )
    assert code == 1
    assert not lines["topic no-such-dlt-topic"][0]
    assert not lines["schemas"][0] and "broken.json" in lines["schemas"][1]
    assert lines["kafka"][0]


def test_check_names_a_topic_that_takes_less_than_the_relay_sends(
    url: str, proxied_broker: tuple[TcpProxy, EmbeddedBroker]
) -> None:
    """A topic whose max.message.bytes is below the relay's message.max.bytes would
    refuse events that enqueue and the relay accept: check says which, and fails.
    (A broker of its own: the small topic would fail every other check.)"""
    kafka_bootstrap = f"127.0.0.1:{proxied_broker[0].port}"
    topic = f"small-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
    created = admin.create_topics([NewTopic(topic, 1, 1, config={"max.message.bytes": "500000"})])
    for future in created.values():
        future.result(30)
    code, lines, text = _check("--bootstrap-servers", kafka_bootstrap, OUTBOX_DATABASE_URL=url)
    assert code == 1, text
    ok, detail = lines["message size"]
    assert not ok
    assert f"topic {topic} (max.message.bytes 500000)" in detail
    assert "message.max.bytes (1048576)" in detail
    # With the relay's limit at the topic's, nothing is smaller.
    code, lines, text = _check(
        "--bootstrap-servers",
        kafka_bootstrap,
        "--kafka-config",
        "message.max.bytes=500000",
        OUTBOX_DATABASE_URL=url,
    )
    assert lines["message size"][0], text


def test_check_fails_on_an_unreachable_database(kafka_bootstrap: str) -> None:
    bad = f"postgresql://app:{SECRET}@127.0.0.1:{free_port()}/app"
    code, lines, text = _check("--bootstrap-servers", kafka_bootstrap, OUTBOX_DATABASE_URL=bad)
    assert code == 1
    assert not lines["database"][0] and not lines["migrations"][0]
    assert "cannot connect" in lines["database"][1]
    assert SECRET not in text


# --------------------------------------------------------------------------- secrets, help


def test_no_command_prints_the_database_password(
    url: str, kafka_bootstrap: str, empty_database: Callable[[], str]
) -> None:
    secret = secret_of(url)
    unreachable = f"postgresql://app:{secret}@127.0.0.1:{free_port()}/app"
    unmigrated = libpq_url(make_url(empty_database()).set(password=secret).render_as_string(False))
    commands = [
        ["stats"],
        ["stats", "--json"],
        ["requeue", "--all", "--dry-run"],
        ["requeue", "--all", "--json"],
        ["unpark", "--all", "--dry-run"],
        ["purge", "--dry-run", "--json"],
        ["purge"],
        ["check", "--bootstrap-servers", kafka_bootstrap],
        ["check", "--json", "--bootstrap-servers", kafka_bootstrap],
    ]
    for target in (url, unreachable, unmigrated):
        for n, args in enumerate(commands):
            # The URL from the flag and from the environment, in turns.
            flags = ["--database-url", target] if n % 2 else []
            if args[0] == "check":
                flags += ["--check-timeout", "2"]
            env = {} if n % 2 else {"OUTBOX_DATABASE_URL": target}
            result = run_cli(*args, *flags, **env)
            output = result.stdout + result.stderr
            assert secret not in output, (target, args, output)
            assert "Traceback" not in output, output
            # Against the good database every command works; against the others none does.
            assert (result.returncode == 0) == (target == url), (target, args, output)


@pytest.mark.parametrize(
    ("command", "variables"),
    [
        ("stats", ["OUTBOX_PARKED_LIMIT", "OUTBOX_DISCARD_LIMIT", "OUTBOX_NO_DELIVERED"]),
        ("requeue", ["OUTBOX_LIST_LIMIT"]),
        ("unpark", []),
        ("purge", ["OUTBOX_RETAIN_DELIVERED_DAYS", "OUTBOX_RETAIN_DISCARDED_DAYS"]),
        ("check", ["OUTBOX_KAFKA_BOOTSTRAP_SERVERS", "OUTBOX_CHECK_TIMEOUT", "OUTBOX_SCHEMA_DIR"]),
    ],
)
def test_help_names_the_environment_variables(command: str, variables: list[str]) -> None:
    text = ok(command, "--help", OUTBOX_DATABASE_URL=f"postgresql://u:{SECRET}@db.internal/x")
    for variable in ["OUTBOX_DATABASE_URL", "OUTBOX_TABLE", "OUTBOX_DB_SCHEMA", *variables]:
        assert variable in text, variable
    assert SECRET not in text and "db.internal" not in text
    if command == "stats":
        assert "scans the whole table" in " ".join(text.split())
    if command in ("requeue", "unpark"):
        for flag in ("--event-id", "--key", "--type", "--topic", "--since", "--until", "--all"):
            assert flag in text
        assert "--dry-run" in text


def test_operator_commands_on_a_custom_table(url: str, kafka_bootstrap: str) -> None:
    assert "applied migrations" in ok(
        "migrate", "--table", "ops_outbox", "--db-schema", "ops", OUTBOX_DATABASE_URL=url
    )
    doc = as_json("stats", "--table", "ops_outbox", "--db-schema", "ops", OUTBOX_DATABASE_URL=url)
    assert doc["table"] == "ops.ops_outbox" and doc["topics"] == []
    code, lines, _ = _check(
        "--bootstrap-servers",
        kafka_bootstrap,
        OUTBOX_DATABASE_URL=url,
        OUTBOX_TABLE="ops_outbox",
        OUTBOX_DB_SCHEMA="ops",
    )
    assert lines["migrations"] == (True, "ops.ops_outbox is at version 8 (current)")
    assert code == 0
    result = run_cli("stats", "--table", "missing_outbox", OUTBOX_DATABASE_URL=url)
    assert result.returncode == 2
    assert "run outbox-kafka migrate" in result.stderr and SECRET not in result.stderr
