"""``check --source log``: what the log mode needs of the server, one line each, and a
slot the server gave up failing the check, the producers and the relay loudly."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from outbox_kafka.database import make_engine
from outbox_kafka.errors import ConfigurationError
from outbox_kafka.operations import check_log_mode, log_pending_topics
from outbox_kafka.operations.log_setup import set_up_log
from outbox_kafka.relay.log_reader import SlotUnusable
from outbox_kafka.relay.log_relay import LogRelay

from ..log_support import LOG_CHECK_LINES, NAMES, emit, log_database, log_outbox
from ..relay_support import make_settings


def _lines(engine: sa.Engine) -> dict[str, tuple[bool, str]]:
    found = check_log_mode(engine, NAMES)
    assert [r.name for r in found] == LOG_CHECK_LINES
    return {r.name: (r.ok, r.detail) for r in found}


def _major(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return int(conn.exec_driver_sql("SHOW server_version_num").scalar_one()) // 10000


@pytest.fixture
def bare_log_url(logical_server_url: str) -> Iterator[str]:
    """A migrated database on the logical server, without the publication and slot."""
    with log_database(logical_server_url, set_up=False) as url:
        yield url


def test_before_log_setup_it_names_what_is_missing(bare_log_url: str) -> None:
    engine = make_engine(bare_log_url)
    try:
        lines = _lines(engine)
        assert lines["wal_level"] == (True, "logical")
        assert lines["replication role"][0]
        assert not lines["publication"][0]
        assert "run outbox-kafka log-setup" in lines["publication"][1]
        assert not lines["replication slot"][0]
        assert f"{NAMES.log_slot} is missing" in lines["replication slot"][1]
        assert not lines["emit privilege"][0]
        assert "executable by PUBLIC" in lines["emit privilege"][1]

        set_up_log(engine, NAMES)
        lines = _lines(engine)
        assert all(ok for ok, _ in lines.values()), lines
        assert "no relay reads it now" in lines["replication slot"][1]
        assert " of WAL not yet acknowledged, " in lines["replication slot"][1]
        assert "wal_status reserved" in lines["replication slot"][1]
        assert "no limit" in lines["slot WAL limit"][1]
        if _major(engine) >= 17:
            assert lines["slot failover"][1].startswith("off:")
        else:
            assert "keeps slots on the primary only" in lines["slot failover"][1]
    finally:
        engine.dispose()


def test_below_wal_level_logical_it_fails(engine: sa.Engine) -> None:
    with engine.connect() as conn:
        level = conn.exec_driver_sql("SHOW wal_level").scalar_one()
    if level == "logical":
        pytest.skip("the server under test runs with wal_level = logical")
    lines = _lines(engine)
    assert lines["wal_level"] == (
        False,
        f"{level}, not logical: no event written to the log can be read; set "
        "wal_level = logical and restart the server",
    )
    assert not lines["replication slot"][0]


def test_a_role_without_replication_fails(log_url: str) -> None:
    role = f"relay_{uuid.uuid4().hex[:8]}"
    admin = make_engine(log_url)
    with admin.begin() as conn:
        conn.exec_driver_sql(f'CREATE ROLE "{role}" LOGIN')
    engine = make_engine(make_url(log_url).set(username=role).render_as_string(False))
    try:
        lines = _lines(engine)
        assert lines["replication role"] == (
            False,
            "this role has neither REPLICATION nor superuser (nor RDS's rds_replication): the "
            "relay cannot read the slot (ALTER ROLE ... REPLICATION, or the provider's "
            "equivalent)",
        )
        with admin.begin() as conn:
            conn.exec_driver_sql(f'ALTER ROLE "{role}" REPLICATION')
        assert _lines(engine)["replication role"][0]
    finally:
        engine.dispose()
        with admin.begin() as conn:
            conn.exec_driver_sql(f'DROP ROLE "{role}"')
        admin.dispose()


def _set_server(engine: sa.Engine, setting: str, value: str | None) -> None:
    """ALTER SYSTEM ``setting`` (RESET if None), reload, and wait until sessions see it."""
    with engine.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        if value is None:
            auto.exec_driver_sql(f"ALTER SYSTEM RESET {setting}")
        else:
            auto.exec_driver_sql(f"ALTER SYSTEM SET {setting} = '{value}'")
        auto.exec_driver_sql("SELECT pg_reload_conf()")
    expected = "-1" if value is None else value
    deadline = time.monotonic() + 10
    while True:
        with engine.connect() as conn:
            now = conn.exec_driver_sql(f"SHOW {setting}").scalar_one()
        if now == expected:
            return
        assert time.monotonic() < deadline, f"{setting} is still {now}"
        time.sleep(0.05)


def _write_wal(engine: sa.Engine, segments: int) -> None:
    """Fill and switch ``segments`` WAL segments, then checkpoint (which gives up slots
    past max_slot_wal_keep_size)."""
    with engine.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        for _ in range(segments):
            auto.exec_driver_sql(
                "CREATE TABLE wal_filler AS SELECT g, repeat('x', 200) AS pad "
                "FROM generate_series(1, 20000) AS g"
            )
            auto.exec_driver_sql("DROP TABLE wal_filler")
            auto.exec_driver_sql("SELECT pg_switch_wal()")
        auto.exec_driver_sql("CHECKPOINT")


@pytest.fixture
def lost_slot_engine(log_url: str) -> Iterator[sa.Engine]:
    """The log database, whose slot (holding one event) the server gave up: past a
    max_slot_wal_keep_size of 1MB, at a checkpoint."""
    engine = make_engine(log_url)
    try:
        with engine.begin() as conn:
            emit(log_outbox(), conn, "k", 1)
        _set_server(engine, "max_slot_wal_keep_size", "1MB")
        lines = _lines(engine)
        assert "max_slot_wal_keep_size = 1MB" in lines["slot WAL limit"][1]
        _write_wal(engine, 4)
        yield engine
    finally:
        _set_server(engine, "max_slot_wal_keep_size", None)
        engine.dispose()


def test_a_lost_slot_fails_check_and_producers(lost_slot_engine: sa.Engine) -> None:
    engine = lost_slot_engine
    lines = _lines(engine)
    assert lines["replication slot"] == (
        False,
        f"{NAMES.log_slot} is lost: it held more WAL than max_slot_wal_keep_size allows "
        "and the server removed what it held, so the events written since its last "
        "acknowledgement are gone; producers refuse to write until it is dropped "
        f"(SELECT pg_drop_replication_slot('{NAMES.log_slot}')) and made again with "
        "log-setup",
    )
    # A session of its own: one that checked the slot within the last second
    # does not look again until the second is over.
    fresh = sa.create_engine(engine.url, poolclass=sa.NullPool)
    with (
        pytest.raises(sa.exc.DBAPIError, match="no usable replication slot"),
        fresh.begin() as conn,
    ):
        emit(log_outbox(), conn, "k", 2)
    fresh.dispose()
    with pytest.raises(ConfigurationError, match="is lost"):
        set_up_log(engine, NAMES)
    # Nothing to peek at: said once, by the slot's line; the topics' line says why not.
    assert log_pending_topics(engine, NAMES).unread == f"slot {NAMES.log_slot} is lost"


def test_a_lost_slot_fails_the_relay_loudly(
    lost_slot_engine: sa.Engine, log_url: str, kafka_bootstrap: str
) -> None:
    slot = NAMES.log_slot
    relay = LogRelay(make_settings(log_url, kafka_bootstrap))
    try:
        with pytest.raises(SlotUnusable) as caught:
            relay.open()
        message = str(caught.value)
        assert message.startswith(f"replication slot {slot} cannot be read: ")
        assert f"SELECT pg_drop_replication_slot('{slot}')" in message
        assert "run outbox-kafka log-setup" in message

        # Running, it keeps trying, not ready, with the slot gauge up and the reason.
        thread = threading.Thread(target=relay.run)
        thread.start()
        try:
            deadline = time.monotonic() + 20
            while relay.loop_problem(1.0) is None or not relay.metrics.registry.get_sample_value(
                "outbox_log_slot_lost"
            ):
                assert time.monotonic() < deadline, relay.loop_problem(1.0)
                time.sleep(0.05)
            assert relay.loop_problem(1.0) == message
            assert relay.problem_kind() == "the slot cannot be read: lost or missing"
        finally:
            relay.stop()
            thread.join(30)
        assert not thread.is_alive()
    finally:
        relay.close(0)

    cli = str(Path(sys.executable).with_name("outbox-kafka"))
    env = {k: v for k, v in os.environ.items() if not k.startswith("OUTBOX_")}
    args = ["--database-url", log_url, "--bootstrap-servers", kafka_bootstrap]
    done = subprocess.run(
        [cli, "relay", "--source", "log", "--drain", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"outbox-kafka relay: error: {message}" in done.stderr


def test_a_slot_made_again_is_read_and_said_at_once(
    lost_slot_engine: sa.Engine, log_url: str, kafka_bootstrap: str
) -> None:
    """An operator drops the lost slot and makes it again while the relay runs: the
    relay reads it without a restart, and its gauge and readiness say so at once, not
    after the next sample (an hour away here)."""
    relay = LogRelay(make_settings(log_url, kafka_bootstrap, sample_interval=3600.0))
    registry = relay.metrics.registry
    relay.sample()  # the next is due in an hour
    assert registry.get_sample_value("outbox_log_slot_lost") == 1
    thread = threading.Thread(target=relay.run)
    thread.start()
    try:
        deadline = time.monotonic() + 20
        while not registry.get_sample_value("outbox_log_slot_lost"):
            assert time.monotonic() < deadline, relay.loop_problem(1.0)
            time.sleep(0.05)
        with lost_slot_engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            auto.exec_driver_sql(f"SELECT pg_drop_replication_slot('{NAMES.log_slot}')")
        set_up_log(lost_slot_engine, NAMES)
        deadline = time.monotonic() + 20
        while registry.get_sample_value("outbox_log_slot_lost") or relay.loop_problem(1.0):
            assert time.monotonic() < deadline, relay.loop_problem(1.0)
            time.sleep(0.05)
    finally:
        relay.stop()
        thread.join(30)
    assert not thread.is_alive()


def test_the_peek_counts_the_topics_in_commit_order_and_consumes_nothing(log_url: str) -> None:
    engine = make_engine(log_url)
    try:
        for n, topic in enumerate(["a", "b", "a", "a", "c"], 1):
            with engine.begin() as conn:
                log_outbox().enqueue(conn, type="log.test", key="k", data={"n": n}, topic=topic)
        whole = log_pending_topics(engine, NAMES)
        assert (whole.counts, whole.read, whole.complete, whole.unread) == (
            {"a": 3, "b": 1, "c": 1},
            5,
            True,
            None,
        )
        assert log_pending_topics(engine, NAMES) == whole  # nothing consumed
        # A Begin, a message and a Commit per transaction: past 4 rows, the server ends
        # with the second transaction.
        first = log_pending_topics(engine, NAMES, row_limit=4)
        assert (first.counts, first.read, first.complete) == ({"a": 1, "b": 1}, 2, False)
        assert first.read_in == "in commit order"
        fewest = log_pending_topics(engine, NAMES, topic_limit=1)
        assert (fewest.counts, fewest.more_topics) == ({"a": 3}, True)
        with engine.begin() as conn:
            conn.exec_driver_sql(
                "SELECT pg_drop_replication_slot(%(slot)s)", {"slot": NAMES.log_slot}
            )
        assert log_pending_topics(engine, NAMES).unread == f"slot {NAMES.log_slot} is missing"
    finally:
        engine.dispose()
