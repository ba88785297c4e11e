"""One relay process serving three outboxes: two databases, one of them with two schemas."""

from __future__ import annotations

import logging
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from prometheus_client.parser import text_string_to_metric_families

from outbox_kafka import migrate
from outbox_kafka.database import make_engine
from outbox_kafka.naming import TableNames
from outbox_kafka.relay.group import RelayGroup, load_outboxes
from outbox_kafka.relay.serve import ObservabilityServer
from tests.acceptance.test_relay_cli import run_cli
from tests.relay_support import (
    FailingCall,
    consume_all,
    enqueue_bulk,
    make_settings,
    per_key_order,
    seq_events,
    topic_outbox,
)
from tests.support import LogRecords

KEYS = ["k-a", "k-b", "k-c", "k-d"]
EVENTS = 120


@dataclass
class Outboxes:
    """Three outboxes: ``first`` and ``tenant`` in one database, ``second`` in another."""

    file: Path
    engines: dict[str, sa.Engine]
    names: dict[str, TableNames]
    url: str


@pytest.fixture
def three_outboxes(
    database_url: str, empty_database: Callable[[], str], tmp_path: Path
) -> Iterator[Outboxes]:
    other_url = empty_database()
    first = make_engine(database_url)
    second = make_engine(other_url)
    tenant = TableNames(schema="tenant_b")
    with first.begin() as conn:
        conn.exec_driver_sql("CREATE SCHEMA tenant_b")
    migrate(first, tenant)
    migrate(second)
    file = tmp_path / "outboxes.toml"
    file.write_text(
        "[outboxes.first]\n"
        "[outboxes.tenant]\n"
        'schema = "tenant_b"\n'
        "[outboxes.second]\n"
        'database_url_env = "SECOND_DATABASE_URL"\n',
        encoding="utf-8",
    )
    yield Outboxes(
        file=file,
        engines={"first": first, "tenant": first, "second": second},
        names={"first": TableNames(), "tenant": tenant, "second": TableNames()},
        url=other_url,
    )
    first.dispose()
    second.dispose()


def _fill(outboxes: Outboxes, topics: dict[str, str]) -> None:
    for name, engine in outboxes.engines.items():
        names = outboxes.names[name]
        outbox = topic_outbox(table=names.table, db_schema=names.schema)
        enqueue_bulk(engine, outbox, seq_events(topics[name], KEYS, EVENTS), chunk=40)


def _check_topic(bootstrap: str, topic: str) -> None:
    """Every event of ``topic`` arrived, each key's in the order they were written."""
    records = consume_all(bootstrap, topic, EVENTS)
    n_of = {r.event_id: r.value["data"]["n"] for r in records}
    order = per_key_order(records)
    assert sorted(order) == KEYS
    for key, ids in order.items():
        numbers = [n_of[i] for i in ids]
        assert numbers == list(range(EVENTS // len(KEYS))), f"{topic} key {key}: {numbers[:10]}"


def test_a_relay_group_drains_three_outboxes_in_per_key_order_with_labelled_metrics(
    three_outboxes: Outboxes,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SECOND_DATABASE_URL", three_outboxes.url)
    first_url = three_outboxes.engines["first"].url.render_as_string(hide_password=False)
    topics = {name: new_topic(partitions=2) for name in three_outboxes.engines}
    _fill(three_outboxes, topics)
    targets = load_outboxes(
        three_outboxes.file, database_url=first_url, table="outbox", db_schema="public"
    )
    group = RelayGroup(make_settings(first_url, kafka_bootstrap), targets)
    try:
        results = group.drain_all(60)
        server = ObservabilityServer.for_group(group, host="127.0.0.1", port=0).start()
        try:
            exposition = group_exposition(server)
        finally:
            server.close()
    finally:
        group.close()
    assert {name: r.complete for name, r in results.items()} == {
        "first": True,
        "tenant": True,
        "second": True,
    }
    for topic in topics.values():
        _check_topic(kafka_bootstrap, topic)
    published = {
        (s.labels["outbox"], s.labels["topic"]): s.value
        for family in text_string_to_metric_families(exposition)
        if family.name == "outbox_events_published"
        for s in family.samples
        if s.name == "outbox_events_published_total"
    }
    assert published == {(name, topics[name]): EVENTS for name in topics}
    for name, engine in three_outboxes.engines.items():
        names = three_outboxes.names[name]
        with engine.connect() as conn:
            pending = conn.execute(
                sa.text(f"SELECT count(*) FROM {names.qualified_events} WHERE delivered_at IS NULL")
            ).scalar()
        assert pending == 0, name


def group_exposition(server: ObservabilityServer) -> str:
    """A scrape of ``server``'s /metrics."""
    import urllib.request

    with urllib.request.urlopen(server.url("/metrics"), timeout=10) as answer:
        return str(answer.read().decode())


def test_relay_and_check_take_an_outboxes_file(
    three_outboxes: Outboxes,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
) -> None:
    topics = {name: new_topic(partitions=2) for name in three_outboxes.engines}
    _fill(three_outboxes, topics)
    first_url = three_outboxes.engines["first"].url.render_as_string(hide_password=False)
    env = {"SECOND_DATABASE_URL": three_outboxes.url}
    common = [
        "--outboxes-file",
        str(three_outboxes.file),
        "--database-url",
        first_url,
        "--bootstrap-servers",
        kafka_bootstrap,
    ]
    checked = run_cli("check", *common, env=env)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    for name in ("first", "tenant", "second"):
        assert f"database [{name}]" in checked.stdout
        assert f"migrations [{name}]" in checked.stdout
    drained = run_cli("relay", "--drain", "--drain-timeout", "60", *common, env=env)
    assert drained.returncode == 0, drained.stdout + drained.stderr
    for name in ("first", "tenant", "second"):
        assert f"outbox {name}: " in drained.stdout
    for topic in topics.values():
        _check_topic(kafka_bootstrap, topic)


def _check_file(
    outboxes: Outboxes, kafka_bootstrap: str, file: Path
) -> subprocess.CompletedProcess[str]:
    """``outbox-kafka check`` of the outboxes ``file``, the first outbox's URL the default."""
    first_url = outboxes.engines["first"].url.render_as_string(hide_password=False)
    return run_cli(
        "check",
        "--outboxes-file",
        str(file),
        "--database-url",
        first_url,
        "--bootstrap-servers",
        kafka_bootstrap,
    )


def test_check_looks_for_each_outboxs_own_dead_letter_topic(
    three_outboxes: Outboxes, kafka_bootstrap: str, tmp_path: Path
) -> None:
    file = tmp_path / "dead-letters.toml"
    file.write_text(
        '[outboxes.first]\ndead_letter_topic = "no-such-dlt-first"\n'
        '[outboxes.tenant]\nschema = "tenant_b"\n',
        encoding="utf-8",
    )
    checked = _check_file(three_outboxes, kafka_bootstrap, file)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert any("topic no-such-dlt-first" in line and "FAIL" in line for line in lines), lines


def test_check_names_an_outbox_whose_table_is_missing(
    three_outboxes: Outboxes, kafka_bootstrap: str, tmp_path: Path
) -> None:
    file = tmp_path / "missing.toml"
    file.write_text('[outboxes.first]\n[outboxes.ghost]\nschema = "nowhere"\n', encoding="utf-8")
    checked = _check_file(three_outboxes, kafka_bootstrap, file)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    lines = checked.stdout.splitlines()
    assert any("migrations [first]" in line and "OK" in line for line in lines), lines
    assert any("migrations [ghost]" in line and "FAIL" in line for line in lines), lines


def test_an_outboxes_file_that_names_no_url_for_an_entry_is_refused_at_once(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    file = tmp_path / "outboxes.toml"
    file.write_text("[outboxes.orders]\n", encoding="utf-8")
    ran = run_cli(
        "relay", "--outboxes-file", str(file), "--bootstrap-servers", kafka_bootstrap, timeout=30
    )
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert "outbox 'orders' has no database URL" in ran.stderr


def test_the_outboxes_of_a_file_keep_their_own_tables(
    three_outboxes: Outboxes, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SECOND_DATABASE_URL", three_outboxes.url)
    targets = load_outboxes(
        three_outboxes.file, database_url="postgresql://h/db", table="outbox", db_schema="public"
    )
    assert [(t.name, t.db_schema, t.table) for t in targets] == [
        ("first", "public", "outbox"),
        ("tenant", "tenant_b", "outbox"),
        ("second", "public", "outbox"),
    ]
    assert [t.database_url for t in targets] == [
        "postgresql://h/db",
        "postgresql://h/db",
        three_outboxes.url,
    ]


def test_a_topic_two_outboxes_send_to_is_created_and_logged_once(
    three_outboxes: Outboxes,
    kafka_bootstrap: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Both loops find the topic missing at once; one creates it, neither logs it twice."""
    import uuid

    monkeypatch.setenv("SECOND_DATABASE_URL", three_outboxes.url)
    topic = f"created-{uuid.uuid4().hex[:10]}"
    _fill(three_outboxes, dict.fromkeys(three_outboxes.engines, topic))
    first_url = three_outboxes.engines["first"].url.render_as_string(hide_password=False)
    targets = load_outboxes(
        three_outboxes.file, database_url=first_url, table="outbox", db_schema="public"
    )
    logs = LogRecords()
    publisher_log = logging.getLogger("outbox_kafka.publisher")
    publisher_log.addHandler(logs)
    publisher_log.setLevel(logging.INFO)
    group = RelayGroup(make_settings(first_url, kafka_bootstrap, create_topics=2), targets)
    try:
        results = group.drain_all(60)
    finally:
        group.close()
        publisher_log.removeHandler(logs)
    assert all(r.complete for r in results.values()), results
    assert [a["topic"] for a in logs.actions("create_topic")] == [topic]
    assert len(consume_all(kafka_bootstrap, topic, 3 * EVENTS)) == 3 * EVENTS


def test_the_shared_producer_gauges_are_served_once_without_an_outbox_label(
    three_outboxes: Outboxes,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A scrape shows the one producer's statistics once: summing over outboxes adds nothing."""
    monkeypatch.setenv("SECOND_DATABASE_URL", three_outboxes.url)
    topics = {name: new_topic(partitions=2) for name in three_outboxes.engines}
    _fill(three_outboxes, topics)
    first_url = three_outboxes.engines["first"].url.render_as_string(hide_password=False)
    targets = load_outboxes(
        three_outboxes.file, database_url=first_url, table="outbox", db_schema="public"
    )
    settings = make_settings(
        first_url, kafka_bootstrap, kafka_config={"statistics.interval.ms": "200"}
    )
    group = RelayGroup(settings, targets)
    try:
        assert all(r.complete for r in group.drain_all(60).values())
        server = ObservabilityServer.for_group(group, host="127.0.0.1", port=0).start()
        try:
            deadline = time.monotonic() + 10
            while True:  # until a statistics report has come since the sends
                group.publisher.poll(0.1)
                samples = _families(group_exposition(server))
                if samples.get("outbox_kafka_broker_rtt_seconds") or time.monotonic() > deadline:
                    break
        finally:
            server.close()
    finally:
        group.close()
    queue = samples["outbox_kafka_producer_queue_messages"]
    assert [s.labels for s in queue] == [{}]
    rtt = samples["outbox_kafka_broker_rtt_seconds"]
    assert rtt and all(set(s.labels) == {"broker"} for s in rtt), rtt
    assert len({s.labels["broker"] for s in rtt}) == len(rtt)
    # The outboxes' own metrics keep their label.
    outboxes = {s.labels["outbox"] for s in samples["outbox_events_published"]}
    assert outboxes == set(topics)


def _families(exposition: str) -> dict[str, list[Any]]:
    return {
        family.name: list(family.samples) for family in text_string_to_metric_families(exposition)
    }


# --------------------------------------------------------------------------- a loop that fails

#: A hand-made migration turned the topic column into an array (one event to several
#: topics), a schema this relay does not know: a claim brings a list where a topic
#: name belongs, and the loop raises TypeError, not a database error it would retry.
BREAK_TOPIC = "ALTER TABLE {events} ALTER COLUMN topic TYPE text[] USING ARRAY[topic]"
REPAIR_TOPIC = "ALTER TABLE {events} ALTER COLUMN topic TYPE text USING topic[1]"


def _alter(outboxes: Outboxes, name: str, statement: str) -> None:
    with outboxes.engines[name].begin() as conn:
        conn.exec_driver_sql(statement.format(events=outboxes.names[name].qualified_events))


def _two_outboxes(outboxes: Outboxes, tmp_path: Path) -> Path:
    file = tmp_path / "two.toml"
    file.write_text('[outboxes.first]\n[outboxes.tenant]\nschema = "tenant_b"\n', encoding="utf-8")
    return file


def test_an_unexpected_error_in_one_outbox_loop_leaves_the_others_delivering(
    three_outboxes: Outboxes,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import json
    import threading
    import urllib.error
    import urllib.request

    from outbox_kafka.relay import group as group_module
    from tests.relay_support import delivered_count, wait_until

    monkeypatch.setattr(group_module, "RESTART_BACKOFF_BASE", 0.2)
    monkeypatch.setattr(group_module, "RESTART_BACKOFF_CAP", 1.0)
    topics = {"first": new_topic(partitions=2), "tenant": new_topic(partitions=2)}
    engines = {name: three_outboxes.engines[name] for name in topics}
    tenant = topic_outbox(db_schema="tenant_b")
    enqueue_bulk(engines["tenant"], tenant, seq_events(topics["tenant"], KEYS, EVENTS))
    _alter(three_outboxes, "tenant", BREAK_TOPIC)
    first_url = engines["first"].url.render_as_string(hide_password=False)
    targets = load_outboxes(
        _two_outboxes(three_outboxes, tmp_path),
        database_url=first_url,
        table="outbox",
        db_schema="public",
    )
    logs = LogRecords()
    relay_log = logging.getLogger("outbox_kafka.relay")
    relay_log.addHandler(logs)
    group = RelayGroup(make_settings(first_url, kafka_bootstrap), targets)
    server = ObservabilityServer.for_group(group, host="127.0.0.1", port=0)
    server.checks.cache_seconds = 0.0  # a fresh answer to each probe
    server.start()
    ran: list[BaseException | None] = []

    def run() -> None:
        try:
            group.run()
            ran.append(None)
        except BaseException as exc:
            ran.append(exc)

    def ready() -> tuple[int, dict[str, Any]]:
        try:
            with urllib.request.urlopen(server.url("/readyz"), timeout=10) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read())

    def tenant_delivered() -> int:
        with engines["tenant"].connect() as conn:
            return int(
                conn.exec_driver_sql(
                    "SELECT count(*) FROM tenant_b.outbox WHERE delivered_at IS NOT NULL"
                ).scalar_one()
            )

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_until(lambda: len(logs.actions("outbox_failed")) >= 3, 30, what="failures")
        status, answer = ready()
        # The other outbox goes on: events written now are delivered.
        first = topic_outbox()
        enqueue_bulk(engines["first"], first, seq_events(topics["first"], KEYS, EVENTS))
        wait_until(lambda: delivered_count(engines["first"]) == EVENTS, 60, what="first")
        assert thread.is_alive() and not ran
        _alter(three_outboxes, "tenant", REPAIR_TOPIC)
        wait_until(lambda: tenant_delivered() == EVENTS, 60, what="tenant repaired")
        wait_until(lambda: ready()[0] == 200, 30, what="ready again")
        exposition = group_exposition(server)
        stopped_at = time.monotonic()
        group.stop()
        thread.join(group.settings.shutdown_timeout + 5)
        assert not thread.is_alive() and ran == [None], ran
        assert time.monotonic() - stopped_at < group.settings.shutdown_timeout
    finally:
        group.stop()
        thread.join(30)
        server.close()
        group.close()
        relay_log.removeHandler(logs)
    assert status == 503
    assert answer["loop:tenant"] == "failed, restarting", answer
    assert answer["loop:first"] == "ok", answer
    assert "loop:tenant: failed, restarting" in answer["reason"], answer
    failed = [r for r in logs.records if getattr(r, "action", None) == "outbox_failed"]
    assert all(r.outbox == "tenant" for r in failed)  # type: ignore[attr-defined]
    assert "unhashable type: 'list'" in failed[0].error  # type: ignore[attr-defined]
    # The traceback once: the same failure again is one line.
    assert [r.exc_info is not None for r in failed] == [True] + [False] * (len(failed) - 1)
    for topic in topics.values():
        _check_topic(kafka_bootstrap, topic)
    failures = {
        s.labels["outbox"]: s.value
        for s in _families(exposition)["outbox_relay_loop_failures"]
        if s.name.endswith("_total")
    }
    assert failures["first"] == 0 and failures["tenant"] >= len(failed), failures


def test_relay_drain_reports_an_outbox_whose_loop_fails_and_drains_the_others(
    three_outboxes: Outboxes, kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = {"first": new_topic(partitions=2), "tenant": new_topic(partitions=2)}
    enqueue_bulk(
        three_outboxes.engines["first"], topic_outbox(), seq_events(topics["first"], KEYS, EVENTS)
    )
    enqueue_bulk(
        three_outboxes.engines["tenant"],
        topic_outbox(db_schema="tenant_b"),
        seq_events(topics["tenant"], KEYS, EVENTS),
    )
    _alter(three_outboxes, "tenant", BREAK_TOPIC)
    first_url = three_outboxes.engines["first"].url.render_as_string(hide_password=False)
    drained = run_cli(
        "relay",
        "--drain",
        "--drain-timeout",
        "4",
        "--outboxes-file",
        str(_two_outboxes(three_outboxes, tmp_path)),
        "--database-url",
        first_url,
        "--bootstrap-servers",
        kafka_bootstrap,
    )
    assert drained.returncode == 3, drained.stdout + drained.stderr
    lines = drained.stdout.splitlines()
    assert any(
        line.startswith("outbox first: ") and "nothing left pending" in line for line in lines
    ), lines
    assert any(
        line.startswith("outbox tenant: ")
        and "the relay loop failed before (TypeError: unhashable type: 'list')" in line
        and "left pending: 120" in line
        for line in lines
    ), lines
    assert drained.stderr.count("Traceback") == 1, drained.stderr
    _check_topic(kafka_bootstrap, topics["first"])


def test_a_drain_counts_what_a_failed_loop_delivered_before_it_failed(
    three_outboxes: Outboxes,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    earlier, topic = new_topic(partitions=2), new_topic(partitions=2)
    tenant_outbox = topic_outbox(db_schema="tenant_b")
    engine = three_outboxes.engines["tenant"]
    first_url = three_outboxes.engines["first"].url.render_as_string(hide_password=False)
    targets = load_outboxes(
        _two_outboxes(three_outboxes, tmp_path),
        database_url=first_url,
        table="outbox",
        db_schema="public",
    )
    group = RelayGroup(make_settings(first_url, kafka_bootstrap, batch_size=10), targets)
    try:
        # A drain before: what the loop recorded then is not counted again.
        enqueue_bulk(engine, tenant_outbox, seq_events(earlier, KEYS, EVENTS))
        assert group.drain_all(60)["tenant"].report.delivered == EVENTS
        enqueue_bulk(engine, tenant_outbox, seq_events(topic, KEYS, EVENTS))
        # The tenant loop's third claim fails as a bug would, after its first claims
        # (two events of each of the four keys, and a read-ahead) were sent and recorded;
        # the loop started in its place sends the rest.
        store = group.relays["tenant"].store
        claim = FailingCall(store.claim, 3, RuntimeError("a bug in the claim"))
        monkeypatch.setattr(store, "claim", claim)
        results = group.drain_all(60)
    finally:
        group.close()
    tenant = results["tenant"]
    assert claim.calls >= 3
    assert tenant.complete, tenant
    # Every event of this drain counted once: those the failed loop recorded, and the rest.
    assert tenant.report.delivered == EVENTS, tenant.summary()
    assert "the relay loop failed before (RuntimeError: a bug in the claim)" in tenant.summary()
    assert results["first"].complete and results["first"].report.delivered == 0
    _check_topic(kafka_bootstrap, topic)


# --------------------------------------------------------------------------- settings per outbox


def test_each_outbox_loop_runs_with_the_settings_of_its_entry(
    three_outboxes: Outboxes, kafka_bootstrap: str, new_topic: Callable[..., str], tmp_path: Path
) -> None:
    topics = {"first": new_topic(partitions=2), "tenant": new_topic(partitions=2)}
    for name, topic in topics.items():
        names = three_outboxes.names[name]
        enqueue_bulk(
            three_outboxes.engines[name],
            topic_outbox(db_schema=names.schema),
            seq_events(topic, KEYS, EVENTS),
        )
    file = tmp_path / "own.toml"
    file.write_text(
        "[outboxes.first]\nbatch_size = 7\nlease_seconds = 8\n"
        '[outboxes.tenant]\nschema = "tenant_b"\nmax_attempts = 2\non_exhausted = "park"\n',
        encoding="utf-8",
    )
    first_url = three_outboxes.engines["first"].url.render_as_string(hide_password=False)
    targets = load_outboxes(file, database_url=first_url, table="outbox", db_schema="public")
    group = RelayGroup(make_settings(first_url, kafka_bootstrap, batch_size=50), targets)
    try:
        first, tenant = group.relays["first"], group.relays["tenant"]
        assert (first.settings.batch_size, first.settings.lease_seconds) == (7, 8.0)
        assert (tenant.settings.batch_size, tenant.settings.lease_seconds) == (50, 5.0)
        assert (first.policy.max_attempts, tenant.policy.max_attempts) == (50, 2)
        assert tenant.settings.on_exhausted == "park"
        results = group.drain_all(60)
        server = ObservabilityServer.for_group(group, host="127.0.0.1", port=0).start()
        try:
            samples = _families(group_exposition(server))
        finally:
            server.close()
    finally:
        group.close()
    assert all(r.complete for r in results.values()), results
    for topic in topics.values():
        _check_topic(kafka_bootstrap, topic)
    info = {s.labels["outbox"]: s.labels for s in samples["outbox_relay_info"]}
    assert info["tenant"]["on_exhausted"] == "park" and info["first"]["on_exhausted"] == "continue"
    assert info["tenant"]["settings_digest"] != info["first"]["settings_digest"]


def test_relay_and_check_refuse_an_outbox_setting_as_the_option_would(
    tmp_path: Path, kafka_bootstrap: str
) -> None:
    file = tmp_path / "outboxes.toml"
    file.write_text(
        '[outboxes.orders]\ndatabase_url = "postgresql://h/app"\nlease_seconds = 5\n',
        encoding="utf-8",
    )
    common = ["--outboxes-file", str(file), "--bootstrap-servers", kafka_bootstrap]
    refused = (
        "outbox 'orders': the Kafka delivery timeout (10000 ms) must be at most 80% of the lease"
    )
    ran = run_cli("relay", *common, timeout=30)
    assert ran.returncode == 2, ran.stdout + ran.stderr
    assert refused in ran.stderr
    checked = run_cli("check", *common, timeout=60)
    assert checked.returncode == 1, checked.stdout + checked.stderr
    assert any(
        line.startswith("FAIL settings") and refused in line for line in checked.stdout.splitlines()
    )
