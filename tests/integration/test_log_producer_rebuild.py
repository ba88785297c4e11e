"""The log mode's relay replaces a Kafka producer that failed: fatally (its idempotent
session is gone, said in a delivery report or raised by ``poll()``), or stuck, its
deliveries timing out. The stream is read again from the last acknowledgement by a new
producer: nothing lost, each key in commit order, without an operator."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest
import sqlalchemy as sa
from confluent_kafka import KafkaError, KafkaException, Producer

from outbox_kafka.relay.log_relay import LogRelay

from ..log_support import log_outbox
from ..relay_support import consume_all, make_settings, per_key_order
from .test_log_relay import wait_for

EVENTS = 12
KEYS = ("a", "b")


class FailingProducer:
    """A real producer that takes the first ``good`` messages, then fails as ``how`` says:

    - ``reported``: each later message's delivery report is a fatal error;
    - ``raised``: later messages are never reported, and ``poll()`` raises a fatal error;
    - ``timed out``: each later message's delivery report says it timed out.
    """

    def __init__(self, config: dict[str, str], good: int, how: str) -> None:
        self._real = Producer(config)
        self._good = good
        self._how = how
        self._produced = 0
        self._reports: list[Callable[[Any, Any], None]] = []

    def produce(self, topic: str, value: bytes, key: bytes, **kwargs: Any) -> None:
        self._produced += 1
        if self._produced <= self._good:
            self._real.produce(topic, value, key, **kwargs)
        else:
            self._reports.append(kwargs["on_delivery"])

    def poll(self, timeout: float = 0.0) -> int:
        served = self._real.poll(timeout)
        if self._reports and self._how == "raised":
            raise KafkaException(self._error())
        reports, self._reports = self._reports, []
        for report in reports:
            report(self._error(), None)
        return served + len(reports)

    def _error(self) -> KafkaError:
        if self._how == "timed out":
            return KafkaError(KafkaError._MSG_TIMED_OUT, "Local: Message timed out")
        return KafkaError(KafkaError._FATAL, "the producer's session is gone", fatal=True)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _relay_failing_once(
    log_url: str, kafka_bootstrap: str, how: str
) -> tuple[LogRelay, list[object]]:
    made: list[object] = []

    def factory(config: dict[str, str]) -> object:
        producer = FailingProducer(config, 4, how) if not made else Producer(config)
        made.append(producer)
        return producer

    return LogRelay(make_settings(log_url, kafka_bootstrap), producer_factory=factory), made


def _write(log_engine: sa.Engine, topic: str) -> None:
    for n in range(1, EVENTS + 1):
        with log_engine.begin() as conn:
            log_outbox().enqueue(conn, type="log.test", key=KEYS[n % 2], data={"n": n}, topic=topic)


def _assert_all_in_commit_order(kafka_bootstrap: str, topic: str) -> None:
    records = consume_all(kafka_bootstrap, topic, EVENTS)
    by_id = {r.event_id: r.value["data"]["n"] for r in records}
    assert set(by_id.values()) == set(range(1, EVENTS + 1))
    # Sent again after the failure, an event may be on the topic twice: each key's
    # first copies are in commit order.
    assert {key: [by_id[i] for i in ids] for key, ids in per_key_order(records).items()} == {
        key: [n for n in range(1, EVENTS + 1) if KEYS[n % 2] == key] for key in KEYS
    }


@pytest.mark.parametrize("how", ["reported", "raised"])
def test_a_producer_that_fails_fatally_is_replaced_and_the_stream_goes_on(
    log_engine: sa.Engine,
    log_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    how: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    topic = new_topic(1)
    _write(log_engine, topic)
    relay, made = _relay_failing_once(log_url, kafka_bootstrap, how)
    caplog.set_level(logging.INFO, logger="outbox_kafka.relay.log")
    relay.open()
    try:
        assert relay.drain(idle=1.0) == EVENTS
    finally:
        relay.close()
    assert len(made) == 2 and relay.rebuilds == 1
    assert relay.stalled is None and relay.published == EVENTS
    samples = relay.metrics.registry
    assert samples.get_sample_value("outbox_log_producer_rebuilds_total") == 1
    assert samples.get_sample_value("outbox_log_stalls_total") == 0
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("producer_fatal") == 1 and actions.count("rebuild") == 1
    _assert_all_in_commit_order(kafka_bootstrap, topic)


def test_a_producer_whose_deliveries_time_out_is_replaced_after_the_stall(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A producer stuck without a fatal error (every delivery times out) would stall the
    stream for good if it were kept: the stream is read again by a new one."""
    topic = new_topic(1)
    _write(log_engine, topic)
    relay, made = _relay_failing_once(log_url, kafka_bootstrap, "timed out")
    worker = threading.Thread(target=relay.run, daemon=True)
    worker.start()
    try:
        assert wait_for(
            lambda: relay.published == EVENTS and relay.loop_problem(1.0) is None, 30.0
        ), relay.stalled
    finally:
        relay.stop()
        worker.join(30)
    assert not worker.is_alive()
    assert len(made) == 2 and relay.rebuilds == 1
    samples = relay.metrics.registry
    assert samples.get_sample_value("outbox_log_stalls_total") == 1
    assert samples.get_sample_value("outbox_log_stalled") == 0
    _assert_all_in_commit_order(kafka_bootstrap, topic)


def test_readiness_names_a_fatal_error_until_the_stream_is_read_again(
    log_engine: sa.Engine, log_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(1)
    _write(log_engine, topic)
    made: list[object] = []

    def factory(config: dict[str, str]) -> object:
        producer = FailingProducer(config, 4, "raised") if not made else Producer(config)
        made.append(producer)
        return producer

    settings = make_settings(log_url, kafka_bootstrap, backoff_base=2.0, backoff_cap=2.0)
    relay = LogRelay(settings, producer_factory=factory)
    worker = threading.Thread(target=relay.run, daemon=True)
    worker.start()
    try:
        assert wait_for(lambda: "failed fatally" in (relay.loop_problem(1.0) or ""), 30.0)
        assert relay.published < EVENTS
        assert wait_for(
            lambda: relay.published == EVENTS and relay.loop_problem(1.0) is None, 30.0
        ), relay.loop_problem(1.0)
    finally:
        relay.stop()
        worker.join(30)
    assert not worker.is_alive()
    _assert_all_in_commit_order(kafka_bootstrap, topic)


def test_a_new_producer_that_cannot_be_made_is_tried_again(
    log_engine: sa.Engine,
    log_url: str,
    kafka_bootstrap: str,
    new_topic: Callable[..., str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The factory refusing once (a broker address that does not resolve yet, say)
    neither ends the relay nor leaves it with the dead producer: it tries again."""
    topic = new_topic(1)
    _write(log_engine, topic)
    made: list[object] = []

    def factory(config: dict[str, str]) -> object:
        made.append(config)
        if len(made) == 1:
            return FailingProducer(config, 4, "reported")
        if len(made) == 2:
            raise KafkaException(KafkaError(KafkaError._INVALID_ARG, "not now"))
        return Producer(config)

    relay = LogRelay(make_settings(log_url, kafka_bootstrap), producer_factory=factory)
    caplog.set_level(logging.INFO, logger="outbox_kafka.relay.log")
    relay.open()
    try:
        assert relay.drain(idle=1.0) == EVENTS
    finally:
        relay.close()
    assert len(made) == 3 and relay.rebuilds == 1
    assert relay.stalled is None and relay.published == EVENTS
    actions = [getattr(r, "action", None) for r in caplog.records]
    assert actions.count("rebuild_failed") == 1 and actions.count("rebuild") == 2
    assert actions.count("producer_fatal") == 1
    _assert_all_in_commit_order(kafka_bootstrap, topic)
