"""The log mode's relay and what a broker refuses for one message: an event over its
topic's ``max.message.bytes`` (found before it is produced, where the broker tells the
limit), and a record batch refused whole, whose events are sent again one at a time
so that the broker's answer names the one it refuses."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import sqlalchemy as sa
from confluent_kafka.admin import AdminClient, NewTopic

from outbox_kafka.demo.embedded import EmbeddedBroker
from outbox_kafka.relay.log_relay import LogRelay, LogStalled

from ..log_support import log_outbox
from ..relay_support import NO_POISON, consume_all, make_settings, per_key_order


def _topic(bootstrap: str, name: str, limit: int | None = None) -> str:
    config = {} if limit is None else {"max.message.bytes": str(limit)}
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(name, 1, 1, config=config)]).values():
        future.result(30)
    return name


def _emit(conn: sa.Connection, topic: str, key: str, n: int, **data: object) -> None:
    log_outbox().enqueue(conn, type="log.test", key=key, data={"n": n, **data}, topic=topic)


# The topics with small limits are on a broker of their own: on the session's broker
# they would fail every other test's `check` (message size).


def test_an_event_over_its_topics_limit_goes_to_the_dead_letter_topic(
    log_engine: sa.Engine, log_url: str, validating_broker: tuple[EmbeddedBroker, Path]
) -> None:
    kafka_bootstrap = validating_broker[0].bootstrap
    topic = _topic(kafka_bootstrap, "small", 3000)
    dead = _topic(kafka_bootstrap, "small-dead")
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 1)
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 2, pad="x" * 4000)
        _emit(conn, topic, "k", 3)
    relay = LogRelay(make_settings(log_url, kafka_bootstrap, dead_letter_topic=dead))
    relay.open()
    try:
        assert relay.drain(idle=0.5, deadline=30.0) == 3
        assert (relay.published, relay.dead_lettered, relay.stalled) == (2, 1, None)
    finally:
        relay.close()
    assert [r.value["data"]["n"] for r in consume_all(kafka_bootstrap, topic, 2)] == [1, 3]
    (copy,) = consume_all(kafka_bootstrap, dead, 1)
    assert copy.value["data"]["n"] == 2
    error = copy.headers["outbox_error"].decode()
    assert error.startswith("MSG_SIZE_TOO_LARGE: message is ")
    assert error.endswith(
        f"bytes, over topic {topic!r}'s max.message.bytes (3000); raise it to publish such events"
    )


def test_a_dead_letter_copy_over_the_dead_letter_topics_limit_stalls_the_stream(
    log_engine: sa.Engine, log_url: str, validating_broker: tuple[EmbeddedBroker, Path]
) -> None:
    kafka_bootstrap = validating_broker[0].bootstrap
    topic = _topic(kafka_bootstrap, "small", 3000)
    dead = _topic(kafka_bootstrap, "small-dead", 3500)
    with log_engine.begin() as conn:
        _emit(conn, topic, "k", 1, pad="x" * 4000)
    relay = LogRelay(make_settings(log_url, kafka_bootstrap, dead_letter_topic=dead))
    relay.open()
    try:
        with pytest.raises(LogStalled) as stalled:
            relay.drain(idle=0.5, deadline=30.0)
        assert (relay.published, relay.dead_lettered) == (0, 0)
    finally:
        relay.close()
    message = str(stalled.value)
    assert f"over topic {topic!r}'s max.message.bytes (3000)" in message
    assert "its dead-letter copy: MSG_SIZE_TOO_LARGE: message is " in message
    assert f"over topic {dead!r}'s max.message.bytes (3500)" in message


def test_a_refused_record_batch_sets_aside_only_the_event_the_broker_refuses_alone(
    log_engine: sa.Engine,
    log_url: str,
    validating_broker: tuple[EmbeddedBroker, Path],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The broker refuses the whole record batch a poisoned event is in: the stream is
    read again at once (no stall), its events one at a time, and only the poisoned one
    goes to the dead-letter topic; every key's other events follow in commit order."""
    broker, schemas = validating_broker
    (schemas / "strict.json").write_text(NO_POISON)
    topic, dead = _topic(broker.bootstrap, "strict"), _topic(broker.bootstrap, "strict-dead")
    n = 0
    expected: dict[str, list[int]] = {k: [] for k in "abc"}
    for _ in range(3):
        with log_engine.begin() as conn:
            for key in "abc":
                n += 1
                if n == 5:
                    _emit(conn, topic, key, n, poison=True)
                else:
                    _emit(conn, topic, key, n)
                    expected[key].append(n)
    caplog.set_level(logging.INFO, logger="outbox_kafka.relay.log")
    relay = LogRelay(make_settings(log_url, broker.bootstrap, dead_letter_topic=dead))
    relay.open()
    try:
        assert relay.drain(idle=1.0, deadline=60.0) == 9
        assert (relay.published, relay.dead_lettered, relay.stalled) == (8, 1, None)
        assert relay.metrics.registry.get_sample_value("outbox_log_stalls_total") == 0
    finally:
        relay.close()
    assert "send_alone" in [getattr(r, "action", None) for r in caplog.records]
    records = consume_all(broker.bootstrap, topic, 8)
    by_id = {r.event_id: r.value["data"]["n"] for r in records}
    # Sent again one at a time, an event of the refused batch's stretch may be on the
    # topic twice: each key's first copies are in commit order.
    assert {key: [by_id[i] for i in ids] for key, ids in per_key_order(records).items()} == (
        expected
    )
    (copy,) = consume_all(broker.bootstrap, dead, 1)
    assert copy.value["data"] == {"n": 5, "poison": True}
    assert copy.headers["outbox_error"].endswith(b"(refused when sent alone)")
