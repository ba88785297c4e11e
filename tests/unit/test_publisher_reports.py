"""Delivery reports served by another loop's wait: whole, and never after the wait ended."""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from outbox_kafka.logs import LIBRDKAFKA_LOGGER
from outbox_kafka.relay.batch import Verdict
from outbox_kafka.relay.ports import Message
from outbox_kafka.relay.send import Publisher


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
