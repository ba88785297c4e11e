"""The log mode's relay loop on a real server (wal_level = logical) and broker: commit
order under interleaved writers with rollbacks, at least once across a crash before
the acknowledgement, and a stream that stops before an event Kafka will not take."""

from __future__ import annotations

import math
import random
import re
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_kafka.demo.embedded import EmbeddedBroker
from outbox_kafka.log_frames import FramedEvent, encode_frame
from outbox_kafka.relay.log_reader import LogReader
from outbox_kafka.relay.log_relay import LogRelay, LogStalled

from ..log_support import NAMES, keys_and_ns, log_outbox
from ..relay_support import TcpProxy, consume_all, make_settings, per_key_order


def _emit(conn: sa.Connection, topic: str, key: str, n: int) -> None:
    log_outbox().enqueue(conn, type="log.test", key=key, data={"n": n}, topic=topic)


def _relay(log_url: str, kafka_bootstrap: str) -> LogRelay:
    relay = LogRelay(make_settings(log_url, kafka_bootstrap))
    relay.open()
    return relay


def test_interleaved_writers_with_rollbacks_reach_kafka_in_commit_order(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(4)
    rng = random.Random(7)
    keys = [f"k{i}" for i in range(8)]
    writers = [log_engine.connect() for _ in range(4)]
    # Each writer keeps its transaction open over several steps, so that transactions
    # overlap and commit in another order than they began and wrote in.
    open_events: list[list[tuple[str, int]]] = [[] for _ in writers]
    expected: dict[str, list[int]] = {k: [] for k in keys}
    counter = 0
    try:
        for _ in range(400):
            w = rng.randrange(len(writers))
            conn = writers[w]
            if not conn.in_transaction():
                conn.begin()
            action = rng.random()
            if action < 0.6:
                counter += 1
                key = rng.choice(keys)
                _emit(conn, topic, key, counter)
                open_events[w].append((key, counter))
            elif action < 0.7:
                savepoint = conn.begin_nested()
                counter += 1
                _emit(conn, topic, rng.choice(keys), -counter)
                savepoint.rollback()
            elif action < 0.77:
                conn.rollback()
                open_events[w] = []
            else:
                conn.commit()
                for key, n in open_events[w]:
                    expected[key].append(n)
                open_events[w] = []
        for w, conn in enumerate(writers):
            if conn.in_transaction():
                conn.commit()
                for key, n in open_events[w]:
                    expected[key].append(n)
    finally:
        for conn in writers:
            conn.close()
    total = sum(len(ns) for ns in expected.values())
    relay = _relay(log_url, kafka_bootstrap)
    try:
        assert relay.drain(idle=1.0) == total
    finally:
        relay.close()
    records = consume_all(kafka_bootstrap, topic, total)
    assert len(records) == total, "duplicates or strays on the topic"
    by_id = {r.event_id: r.value["data"]["n"] for r in records}
    found = {key: [by_id[i] for i in ids] for key, ids in per_key_order(records).items()}
    assert found == {k: ns for k, ns in expected.items() if ns}
    # Not vacuous: some key's commit order differs from the order its events were written.
    assert any(ns != sorted(ns) for ns in expected.values())


def test_a_crash_before_the_acknowledgement_sends_again_only_what_followed_it(
    log_engine: sa.Engine,
    log_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = new_topic(2)
    for n in range(1, 11):
        with log_engine.begin() as conn:
            _emit(conn, topic, "k", n)
    first = _relay(log_url, kafka_bootstrap)
    try:
        assert first.drain(idle=0.5) == 10
        for n in range(11, 21):
            with log_engine.begin() as conn:
                _emit(conn, topic, "k", n)
        # Published and delivered, but the process dies before telling the server.
        monkeypatch.setattr(first.reader, "acknowledge", lambda end_lsn: None)
        first.drain(idle=0.5)
    finally:
        first.close()
    second = _relay(log_url, kafka_bootstrap)
    try:
        assert second.drain(idle=0.5) == 10
    finally:
        second.close()
    records = consume_all(kafka_bootstrap, topic, 20)
    counts = Counter(r.value["data"]["n"] for r in records)
    assert counts == Counter({**dict.fromkeys(range(1, 11), 1), **dict.fromkeys(range(11, 21), 2)})
    (ids,) = per_key_order(records).values()
    by_id = {r.event_id: r.value["data"]["n"] for r in records}
    assert [by_id[i] for i in ids] == list(range(1, 21))


def test_an_event_kafka_will_not_take_stops_the_stream_before_it(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(1)
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 1)
    with log_engine.begin() as conn:
        _emit(conn, "no-such-topic-" + topic, "k", 2)
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 3)
    relay = _relay(log_url, kafka_bootstrap)
    try:
        with pytest.raises(
            LogStalled, match=r"key 'k', topic 'no-such-topic-.*stream stops before it"
        ):
            relay.drain(idle=0.5, deadline=30.0)
        assert relay.published == 1
    finally:
        relay.close()
    # The next reader starts at the event that stopped it.
    reader = LogReader(log_url, NAMES)
    reader.open()
    try:
        assert keys_and_ns(reader.read(2.0))[0] == [("k", 2)]
    finally:
        reader.close()


def _emit_frame(conn: sa.Connection, topic: str, key: str, value: bytes) -> None:
    """A frame written past the library, straight into the emit function."""
    frame = encode_frame([FramedEvent(uuid.uuid4(), key, topic, "log.test", [], value)])
    conn.exec_driver_sql("SELECT outbox_emit(%(frame)s)", {"frame": frame})


def test_an_event_kafka_will_never_take_goes_to_the_dead_letter_topic_and_its_key_goes_on(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Frames written past the library, one whose value is not the envelope of its id
    and one for a topic name Kafka refuses, are found before they are produced: each
    goes to the dead-letter topic with why, and its key's later events follow on the
    topic, nothing stalled."""
    topic, dead = new_topic(1), new_topic(1)
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 1)
    with log_engine.begin() as conn:
        _emit_frame(conn, topic, "k", b'{"not": "an envelope"}')
        _emit(conn, topic, "k", 3)
    with log_engine.begin() as conn:
        _emit_frame(conn, "bad topic name", "k", b"{}")
        _emit(conn, topic, "k", 5)
    relay = LogRelay(make_settings(log_url, kafka_bootstrap, dead_letter_topic=dead))
    relay.open()
    try:
        assert relay.drain(idle=0.5, deadline=30.0) == 5
        assert (relay.published, relay.dead_lettered, relay.stalled) == (3, 2, None)
        registry = relay.metrics.registry
        assert registry.get_sample_value("outbox_log_dead_lettered_total") == 2
        assert registry.get_sample_value("outbox_log_published_total") == 3
    finally:
        relay.close()
    on_topic = consume_all(kafka_bootstrap, topic, 3)
    assert [r.value["data"]["n"] for r in on_topic] == [1, 3, 5]
    copies = consume_all(kafka_bootstrap, dead, 2)
    assert [r.headers["outbox_original_topic"] for r in copies] == [
        topic.encode(),
        b"bad topic name",
    ]
    assert copies[0].headers["outbox_error"].startswith(b"INVALID_ENVELOPE: ")
    assert copies[1].headers["outbox_error"].startswith(b"INVALID_TOPIC: ")
    assert [r.key for r in copies] == ["k", "k"]
    assert copies[0].raw == b'{"not": "an envelope"}'
    # Nothing is left to read: all five were acknowledged.
    reader = LogReader(log_url, NAMES)
    reader.open()
    try:
        assert reader.read(1.0) == []
    finally:
        reader.close()


@pytest.mark.parametrize("dead_letter", [False, True], ids=["no dead-letter topic", "too large"])
def test_an_event_that_cannot_be_set_aside_stalls_the_stream(
    log_engine: sa.Engine,
    log_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    dead_letter: bool,
) -> None:
    """Nothing keeps an event of the log but Kafka: with no dead-letter topic, or with a
    copy too large for it (an event over the relay's message.max.bytes), the stream
    stops before it rather than lose it."""
    topic = new_topic(1)
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 1)
        log_outbox().enqueue(
            conn, type="log.test", key="k", data={"n": 2, "pad": "x" * 30_000}, topic=topic
        )
    settings = make_settings(
        log_url,
        kafka_bootstrap,
        kafka_config={"message.max.bytes": "20000"},
        dead_letter_topic=new_topic(1) if dead_letter else None,
    )
    relay = LogRelay(settings)
    relay.open()
    try:
        with pytest.raises(LogStalled) as stalled:
            relay.drain(idle=0.5, deadline=30.0)
        assert relay.published == 0
    finally:
        relay.close()
    message = str(stalled.value)
    assert "MSG_SIZE_TOO_LARGE: message is " in message
    assert message.endswith(
        "the stream stops before it, nothing acknowledged since the relay started"
    )
    assert ("dead-letter copy" in message) == dead_letter


def test_a_stall_holds_the_stream_until_kafka_takes_the_event_then_goes_on(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """In run mode a stall is retried: nothing after it is acknowledged, readiness
    names it, and once the topic exists the stream goes on, nothing lost."""
    topic = new_topic(1)
    late = f"late-{topic}"
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 1)
    with log_engine.begin() as conn:
        _emit(conn, late, "k", 2)
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 3)
    relay = LogRelay(make_settings(log_url, kafka_bootstrap))
    worker = threading.Thread(target=relay.run, daemon=True)
    worker.start()
    try:
        assert wait_for(lambda: relay.stalled is not None, 30.0), "no stall"
        problem = relay.loop_problem(1.0)
        assert problem is not None and problem.startswith("stalled: event ")
        assert f"UNKNOWN_TOPIC: topic {late!r} does not exist and topic creation is off" in problem
        assert relay.problem_kind() == "stalled at an event Kafka does not take"
        # Event 1 was acknowledged: the position is said as PostgreSQL writes it.
        assert re.search(r"acknowledged up to LSN [0-9A-F]+/[0-9A-F]+$", problem), problem
        assert relay.metrics.registry.get_sample_value("outbox_log_stalled") == 1
        assert relay.published == 1
        admin = AdminClient({"bootstrap.servers": kafka_bootstrap})
        for future in admin.create_topics([NewTopic(late, 1, 1)]).values():
            future.result(30)
        assert wait_for(lambda: relay.published == 3, 30.0), relay.stalled
        assert relay.loop_problem(1.0) is None
        assert relay.metrics.registry.get_sample_value("outbox_log_stalled") == 0
        assert relay.metrics.registry.get_sample_value("outbox_log_stalls_total") == 1
    finally:
        relay.stop()
        worker.join(30)
    assert not worker.is_alive()
    # Event 3 may have reached Kafka before the stall and again after it: its first
    # copy counts, after event 1, and nothing is lost.
    on_topic = consume_all(kafka_bootstrap, topic, 2)
    (ids,) = per_key_order(on_topic).values()
    by_id = {r.event_id: r.value["data"]["n"] for r in on_topic}
    assert [by_id[i] for i in ids] == [1, 3]
    assert [r.value["data"]["n"] for r in consume_all(kafka_bootstrap, late, 1)] == [2]


def wait_for(condition: Callable[[], bool], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_the_slot_is_sampled_into_gauges_and_a_missing_slot_is_said(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(1)
    relay = _relay(log_url, kafka_bootstrap)
    value = relay.metrics.registry.get_sample_value
    try:
        for n in range(1, 51):
            with log_engine.begin() as conn:
                _emit(conn, topic, "k", n)
        relay.sample()
        held = value("outbox_log_slot_lag_bytes")
        assert held is not None and held > 50 * 400, held
        assert math.isnan(value("outbox_log_slot_safe_wal_bytes") or 0.0)
        assert value("outbox_log_slot_lost") == 0
        assert relay.drain(idle=0.5) == 50

        def lag_after_acknowledgement() -> bool:
            relay.sample()
            lag = value("outbox_log_slot_lag_bytes")
            return lag is not None and lag < held

        assert wait_for(lag_after_acknowledgement, 10.0), value("outbox_log_slot_lag_bytes")
    finally:
        relay.close()
    with log_engine.begin() as conn:
        conn.exec_driver_sql("SELECT pg_drop_replication_slot(%(s)s)", {"s": NAMES.log_slot})
    orphan = LogRelay(make_settings(log_url, kafka_bootstrap))
    try:
        orphan.sample()
        assert orphan.metrics.registry.get_sample_value("outbox_log_slot_lost") == 1
        assert orphan.loop_problem(1.0) == (
            f"replication slot {NAMES.log_slot} is missing: run outbox-kafka log-setup"
        )
    finally:
        orphan.close()


def _walsender_pids(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return list(
            conn.exec_driver_sql(
                "SELECT active_pid FROM pg_replication_slots "
                "WHERE slot_name = %(s)s AND active_pid IS NOT NULL",
                {"s": NAMES.log_slot},
            ).scalars()
        )


def test_a_wait_for_kafka_longer_than_wal_sender_timeout_keeps_the_session(
    log_engine: sa.Engine, log_url: str, proxied_broker: tuple[TcpProxy, EmbeddedBroker]
) -> None:
    """While events are in flight the relay reads nothing; it tells the server it
    lives often enough for the server's wal_sender_timeout (2 s here, for a wait of
    Kafka's 3 s delivery timeout: the broker stops answering), so the session is the
    same one throughout."""
    proxy, _ = proxied_broker
    topic = "waited-for"
    admin = AdminClient({"bootstrap.servers": f"127.0.0.1:{proxy.port}"})
    for future in admin.create_topics([NewTopic(topic, 1, 1)]).values():
        future.result(30)
    with log_engine.connect() as conn:
        auto = conn.execution_options(isolation_level="AUTOCOMMIT")
        auto.exec_driver_sql("ALTER SYSTEM SET wal_sender_timeout = '2s'")
        auto.exec_driver_sql("SELECT pg_reload_conf()")
    try:
        with log_engine.begin() as conn:
            _emit(conn, topic, "k", 1)
        relay = LogRelay(make_settings(log_url, f"127.0.0.1:{proxy.port}"))
        relay.open()
        try:
            assert relay.drain(idle=0.5) == 1  # the topic is known now
            with log_engine.begin() as conn:
                _emit(conn, topic, "k", 2)
            proxy.hang()
            assert relay.step(0.5) == 0  # produced, waiting for Kafka
            pids = set(_walsender_pids(log_engine))
            assert len(pids) == 1, (relay.stalled, relay.problem, relay.loop_problem(1.0))
            deadline = time.monotonic() + 30
            while relay.stalled is None:
                assert time.monotonic() < deadline, "no stall"
                relay.step(0.2)
                if relay.stalled is None:
                    assert set(_walsender_pids(log_engine)) == pids
        finally:
            proxy.restore()
            relay.close(0)
        assert f"topic {topic!r}" in relay.stalled
    finally:
        with log_engine.connect() as conn:
            auto = conn.execution_options(isolation_level="AUTOCOMMIT")
            auto.exec_driver_sql("ALTER SYSTEM RESET wal_sender_timeout")
            auto.exec_driver_sql("SELECT pg_reload_conf()")


def test_a_drain_ends_while_other_prefixes_keep_writing_to_the_log(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Another tool's transactional messages stream on without end: the relay reads
    past them, publishes its own, and a drain still ends once its own are done."""
    topic = new_topic(1)
    with log_engine.begin() as conn:
        for n in range(1, 21):
            _emit(conn, topic, "k", n)
    stop = threading.Event()

    def foreign() -> None:
        with log_engine.connect() as conn:
            while not stop.is_set():
                with conn.begin():
                    conn.exec_driver_sql("SELECT pg_logical_emit_message(true, 'other', 'x')")
                time.sleep(0.005)

    writer = threading.Thread(target=foreign, daemon=True)
    writer.start()
    relay = _relay(log_url, kafka_bootstrap)
    try:
        assert relay.drain(idle=0.5, deadline=20.0) == 20
        assert relay.reader.strays.foreign > 0
    finally:
        stop.set()
        writer.join(10)
        relay.close()
    on_topic = consume_all(kafka_bootstrap, topic, 20)
    assert [r.value["data"]["n"] for r in on_topic] == list(range(1, 21))
