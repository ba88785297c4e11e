"""Delivery reports served by another loop's wait: whole, and never after the wait ended."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox_kafka.logs import LIBRDKAFKA_LOGGER
from outbox_kafka.relay.batch import Verdict
from outbox_kafka.relay.ports import Message
from outbox_kafka.relay.send import STALLED_BATCHES, Publisher


class _Reported:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset


class HeldProducer:
    """Takes messages and reports them only when told: as a broker that answers late."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def produce(self, topic: str, value: bytes, key: bytes, **kwargs: Any) -> None:
        self.callbacks.append(kwargs["on_delivery"])

    def flush(self, timeout: float) -> int:
        threading.Event().wait(min(timeout, 0.01))
        return len(self.callbacks)

    def poll(self, timeout: float = 0.0) -> int:
        return self.report_all()

    def report_all(self) -> int:
        served, self.callbacks = self.callbacks, []
        for offset, callback in enumerate(served):
            callback(None, _Reported(0, offset))
        return len(served)


def _publisher(producer: HeldProducer) -> Publisher:
    return Publisher(
        {"bootstrap.servers": "127.0.0.1:1"},
        {},
        make_producer=lambda config: producer,  # type: ignore[arg-type,return-value]
    )


MESSAGES = [Message("t", b"k", b"{}", []), Message("t", b"j", b"{}", [])]


def test_a_report_served_after_the_wait_ended_changes_nothing() -> None:
    producer = HeldProducer()
    publisher = _publisher(producer)
    deliveries = publisher.send(MESSAGES, timeout=0.05, abort=lambda: False)
    assert [(d.sent, d.reported) for d in deliveries] == [(True, False), (True, False)]
    # Another loop's poll serves the late reports while this batch is being decided on.
    producer.report_all()
    assert [(d.reported, d.verdict, d.partition) for d in deliveries] == [
        (False, Verdict.RETRIABLE, None),
        (False, Verdict.RETRIABLE, None),
    ]
    assert all(d.error and d.error.startswith("NO_REPORT") for d in deliveries)


def test_reports_served_by_another_thread_during_the_wait_arrive_whole() -> None:
    producer = HeldProducer()
    publisher = _publisher(producer)
    other = threading.Timer(0.05, producer.report_all)
    other.start()
    deliveries = publisher.send(MESSAGES, timeout=5.0, abort=lambda: False)
    other.join()
    assert [(d.reported, d.verdict, d.partition, d.offset) for d in deliveries] == [
        (True, Verdict.DELIVERED, 0, 0),
        (True, Verdict.DELIVERED, 0, 1),
    ]


def test_the_admin_clients_librdkafka_messages_go_to_logging_not_stderr(
    capfd: pytest.CaptureFixture[str], caplog: pytest.LogCaptureFixture
) -> None:
    # Its connection failures were written raw to stderr ("%3|…|FAIL|…"), past
    # --log-format json, while the producer's went through logging.
    nowhere = {"bootstrap.servers": "127.0.0.1:1"}
    publisher = Publisher(nowhere, dict(nowhere), metadata_timeout=0.5)
    try:
        with caplog.at_level(logging.DEBUG, logger=LIBRDKAFKA_LOGGER):
            assert publisher.message_limit("t") is None  # the admin client asks, and fails
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline and not any(
                "127.0.0.1:1" in r.getMessage() for r in caplog.records
            ):
                publisher.poll(0.1)
    finally:
        publisher.close(timeout=0)
    assert "FAIL" not in capfd.readouterr().err
    assert any("127.0.0.1:1" in r.getMessage() for r in caplog.records)


def test_a_rebuilt_producer_is_made_as_the_first_was_from_the_same_configuration() -> None:
    made: list[tuple[dict[str, Any], HeldProducer]] = []

    def make(config: dict[str, Any]) -> HeldProducer:
        made.append((config, HeldProducer()))
        return made[-1][1]

    publisher = Publisher({"bootstrap.servers": "127.0.0.1:1"}, {}, make_producer=make)  # type: ignore[arg-type]
    publisher.rebuild()
    assert len(made) == 2 and made[0][0] == made[1][0]
    assert made[0][0]["bootstrap.servers"] == "127.0.0.1:1"
    publisher.send(MESSAGES, timeout=1.0)
    assert [len(p.callbacks) for _, p in made] == [0, 2]  # the new one takes the sends


class _Metadata:
    def __init__(self, brokers: dict[int, object]) -> None:
        self.brokers = brokers
        self.topics: dict[str, object] = {}


class TimingOutProducer(HeldProducer):
    """Reports every message timed out; answers metadata requests while ``answers``:
    an idempotent producer stuck after its broker restarted, or a broker that is down."""

    def __init__(self, answers: bool = True) -> None:
        super().__init__()
        self.answers = answers
        #: When False, every message is delivered instead.
        self.times_out = True

    def flush(self, timeout: float) -> int:
        if not self.times_out:
            return self.report_all()
        served, self.callbacks = self.callbacks, []
        for callback in served:
            callback(KafkaError(KafkaError._MSG_TIMED_OUT), None)
        return 0

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> _Metadata:
        if not self.answers:
            raise KafkaException("_TRANSPORT: Failed to get metadata")
        return _Metadata({1: object()})


def test_a_producer_that_keeps_timing_out_while_the_broker_answers_is_rebuilt(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # Seen after a broker restart: librdkafka's idempotent producer never sent again,
    # every message timed out, and no fatal error came to replace it.
    made: list[TimingOutProducer] = []

    def make(config: dict[str, Any]) -> TimingOutProducer:
        made.append(TimingOutProducer())
        return made[-1]

    publisher = Publisher({"bootstrap.servers": "127.0.0.1:1"}, {}, make_producer=make)  # type: ignore[arg-type]
    with caplog.at_level(logging.WARNING, logger="outbox_kafka.publisher"):
        for _ in range(STALLED_BATCHES - 1):
            deliveries = publisher.send(MESSAGES, timeout=1.0)
            assert all(d.in_doubt for d in deliveries)
        assert len(made) == 1  # a batch or two timing out is an ordinary slow broker
        publisher.send(MESSAGES, timeout=1.0)
    assert len(made) == 2 and publisher.rebuilds == 1
    assert [r.reason for r in caplog.records if getattr(r, "action", "") == "rebuild"] == [  # type: ignore[attr-defined]
        f"{STALLED_BATCHES} batches in a row timed out while the broker answers"
    ]
    # The count starts again with the new producer.
    for _ in range(STALLED_BATCHES - 1):
        publisher.send(MESSAGES, timeout=1.0)
    assert len(made) == 2


def test_a_delivery_between_timeouts_starts_the_count_again() -> None:
    made: list[TimingOutProducer] = []

    def make(config: dict[str, Any]) -> TimingOutProducer:
        made.append(TimingOutProducer())
        return made[-1]

    publisher = Publisher({"bootstrap.servers": "127.0.0.1:1"}, {}, make_producer=make)  # type: ignore[arg-type]
    for _ in range(3):
        for _ in range(STALLED_BATCHES - 1):
            publisher.send(MESSAGES, timeout=1.0)
        made[0].times_out = False  # the next batch is delivered
        deliveries = publisher.send(MESSAGES, timeout=5.0)
        assert all(d.verdict == Verdict.DELIVERED for d in deliveries)
        made[0].times_out = True
    assert len(made) == 1 and publisher.rebuilds == 0


def test_a_producer_timing_out_because_the_broker_is_down_is_kept() -> None:
    made: list[TimingOutProducer] = []

    def make(config: dict[str, Any]) -> TimingOutProducer:
        made.append(TimingOutProducer(answers=False))
        return made[-1]

    publisher = Publisher(
        {"bootstrap.servers": "127.0.0.1:1"},
        {},
        make_producer=make,  # type: ignore[arg-type]
        metadata_timeout=0.1,
    )
    for _ in range(STALLED_BATCHES * 3):
        publisher.send(MESSAGES, timeout=1.0)
    assert len(made) == 1 and publisher.rebuilds == 0
