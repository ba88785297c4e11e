"""A topic that does not exist, as an operator meets it: ``check`` names it with the
events that wait for it, ``relay --drain`` exits non-zero naming the held events and
why, and once the topic is created everything goes out in order."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from pathlib import Path

import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

from outbox_kafka import migrate
from outbox_kafka.database import make_engine
from outbox_kafka.naming import TableNames
from tests.acceptance.test_relay_cli import run_cli
from tests.relay_support import (
    consume_all,
    enqueue_bulk,
    per_key_order,
    rows,
    scalar,
    seq_events,
    topic_outbox,
)

TIMING = ["--lease-seconds", "5", "--delivery-timeout-ms", "3000"]


def _missing_topic() -> str:
    return f"missing-{uuid.uuid4().hex[:12]}"


def _create(bootstrap: str, topic: str, partitions: int = 2) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(topic, partitions, 1)]).values():
        future.result(timeout=30)


def _check(*args: str, env: dict[str, str]) -> tuple[int, dict[str, tuple[bool, str]], str]:
    text = run_cli("check", "--check-timeout", "3", *args, env=env)
    assert "Traceback" not in text.stderr, text.stderr
    doc = json.loads(run_cli("check", "--check-timeout", "3", "--json", *args, env=env).stdout)
    lines = {c["name"]: (c["ok"], c["detail"]) for c in doc["checks"]}
    assert doc["ok"] == (text.returncode == 0)
    return text.returncode, lines, text.stdout


def test_check_names_each_missing_topic_that_pending_events_wait_for(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    present, missing = new_topic(1), _missing_topic()
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, seq_events(present, ["a", "b"], 4))
    enqueue_bulk(engine, outbox, seq_events(missing, ["c", "d", "e"], 7))
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}

    code, lines, text = _check(env=env)
    assert code == 1, text
    assert lines[f"topic {missing}"] == (
        False,
        "missing; 7 pending events wait for it (create it, or let the relay create it: "
        "--create-topics <partitions>)",
    )
    assert lines[f"topic {present}"] == (True, "exists; 4 pending events")
    assert f"FAIL topic {missing}" in text
    assert "pending topics" not in lines, "every pending event was read"

    code, lines, text = _check("--create-topics", "2", env=env)
    assert code == 0, text
    assert lines[f"topic {missing}"] == (True, "missing; the relay creates it (7 pending events)")

    # check reads only: nothing of the outbox changed, the topic was not created.
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == 11
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE last_error IS NOT NULL") == 0
    metadata = AdminClient({"bootstrap.servers": kafka_bootstrap}).list_topics(timeout=10)
    assert missing not in metadata.topics


def test_check_reads_the_pending_topics_of_each_outbox_of_an_outboxes_file(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, tmp_path: Path
) -> None:
    tenant = TableNames(schema="tenant_b")
    with engine.begin() as conn:
        conn.exec_driver_sql("CREATE SCHEMA tenant_b")
    tenant_engine = make_engine(database_url)
    try:
        migrate(tenant_engine, tenant)
        missing = _missing_topic()
        enqueue_bulk(
            tenant_engine, topic_outbox(db_schema="tenant_b"), seq_events(missing, ["k"], 3)
        )
    finally:
        tenant_engine.dispose()
    file = tmp_path / "outboxes.toml"
    file.write_text('[outboxes.first]\n[outboxes.tenant]\nschema = "tenant_b"\n', encoding="utf-8")
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}

    code, lines, text = _check("--outboxes-file", str(file), env=env)
    assert code == 1, text
    ok, detail = lines[f"topic {missing} [tenant]"]
    assert not ok and detail.startswith("missing; 3 pending events wait for it"), detail
    assert not any(name.endswith("[first]") and "topic" in name for name in lines), lines


def test_drain_on_a_missing_topic_exits_non_zero_naming_the_held_events_then_flows(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    topic = _missing_topic()
    events = seq_events(topic, ["a", "b", "c"], 9)
    ids = enqueue_bulk(engine, topic_outbox(), events)
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}

    held = run_cli("relay", "--drain", "--drain-timeout", "3", *TIMING, env=env)
    assert held.returncode == 3, held.stdout + held.stderr
    assert "0 delivered, 0 discarded" in held.stdout
    assert (
        f"left pending: 9 (9 held: UNKNOWN_TOPIC: topic '{topic}' does not exist and topic "
        "creation is off"
    ) in held.stdout, held.stdout
    assert "delayed" not in held.stdout, "held events are not reported as delayed"
    assert "action=hold" in held.stderr
    # Nothing discarded, no attempt counted; each key's first event holds the reason.
    assert rows(
        engine, "SELECT status, attempts, count(*) FROM outbox GROUP BY status, attempts"
    ) == [("pending", 0, 9)]
    reasons = rows(engine, "SELECT ordering_key, seq FROM outbox WHERE last_error IS NOT NULL")
    assert sorted(tuple(r) for r in reasons) == [("a", 1), ("b", 1), ("c", 1)]

    _create(kafka_bootstrap, topic)
    result = run_cli("relay", "--drain", "--drain-timeout", "30", *TIMING, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "drained: 9 delivered, 0 discarded" in result.stdout
    assert "nothing left pending" in result.stdout
    records = consume_all(kafka_bootstrap, topic, len(ids))
    expected = {k: [i for e, i in zip(events, ids, strict=True) if e.key == k] for k in "abc"}
    assert per_key_order(records) == expected


def test_a_topic_created_during_a_drain_lets_the_held_keys_flow(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str
) -> None:
    """The held keys are looked at again every few seconds while the drain waits."""
    import subprocess
    import threading
    import time

    topic = _missing_topic()
    ids = enqueue_bulk(engine, topic_outbox(), seq_events(topic, ["a", "b"], 6))
    env = {"OUTBOX_DATABASE_URL": database_url, "OUTBOX_KAFKA_BOOTSTRAP_SERVERS": kafka_bootstrap}
    done: list[subprocess.CompletedProcess[str]] = []
    drain = threading.Thread(
        target=lambda: done.append(
            run_cli("relay", "--drain", "--drain-timeout", "60", *TIMING, env=env)
        )
    )
    drain.start()
    deadline = time.monotonic() + 30
    while not scalar(engine, "SELECT count(*) FROM outbox WHERE last_error IS NOT NULL"):
        assert time.monotonic() < deadline, "the relay never held the key"
        time.sleep(0.2)
    _create(kafka_bootstrap, topic)
    drain.join(90)
    [result] = done
    assert result.returncode == 0, result.stdout + result.stderr
    assert "drained: 6 delivered" in result.stdout
    assert len(consume_all(kafka_bootstrap, topic, len(ids))) == len(ids)
