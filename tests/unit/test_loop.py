"""The relay loop (outbox_kafka/relay/loop.py): drain() and run()/stop() on the
in-memory store and the stub publisher, the record step retried through database
errors, and the loop's DatabaseRetry and SupervisedLoop (no services)."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from outbox_kafka.errors import StorageError
from outbox_kafka.relay.batch import Claim, EventOutcome, KeyOutcome, RecordResult, Verdict
from outbox_kafka.relay.decide import Settlement
from outbox_kafka.relay.loop import DatabaseRetry, SupervisedLoop
from outbox_kafka.relay.observe import RelayObserver
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.testing import InMemoryStore, StubPublisher
from tests.fakes_support import enqueue, relay_on_fakes
from tests.relay_support import running_relay


class _Announcements(RelayObserver):
    """What the relay announced, in order: each step and the keys it concerned."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.heard: list[tuple[str, Any]] = []

    def _hear(self, what: str, detail: object) -> None:
        with self.lock:
            self.heard.append((what, detail))

    def claimed(self, claim: Claim, seconds: float) -> None:
        if claim.keys:
            self._hear("claimed", [k.key for k in claim.keys])

    def settled(self, settlement: Settlement) -> None:
        self._hear("settled", (settlement.key.key, len(settlement.delivered)))

    def sent(self, claim: Claim, seconds: float) -> None:
        self._hear("sent", [k.key for k in claim.keys])

    def recorded(self, result: RecordResult, seconds: float) -> None:
        self._hear("recorded", result.delivered)

    def database_retry(self, attempt: int, error: BaseException | None) -> None:
        self._hear("database_retry", str(error))

    def background_failed(self, task: str, error: Exception) -> None:
        self._hear("background_failed", (task, str(error)))

    def said(self, what: str) -> list[Any]:
        with self.lock:
            return [detail for heard, detail in self.heard if heard == what]


class _SlowRecords(InMemoryStore):
    """Each record takes ``seconds``; the first ``failures`` then fail as a lost
    connection does."""

    def __init__(self, *, failures: int = 0, seconds: float = 0.0) -> None:
        super().__init__()
        self.failures = failures
        self.seconds = seconds

    def record(
        self, token: uuid.UUID, keys: Sequence[KeyOutcome], events: Sequence[EventOutcome]
    ) -> RecordResult:
        time.sleep(self.seconds)
        if self.failures:
            self.failures -= 1
            raise StorageError("connection reset by peer")
        return super().record(token, keys, events)


class _HeldSend(StubPublisher):
    """A broker that answers a send only once ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.sending = threading.Event()
        self.release = threading.Event()

    def send(
        self,
        messages: Sequence[Message],
        *,
        timeout: float,
        abort: Callable[[], bool] | None = None,
    ) -> list[Delivery]:
        self.sending.set()
        self.release.wait(10)
        return super().send(messages, timeout=timeout, abort=abort)


# ------------------------------------------------------------------------ drain


def test_drain_publishes_everything_due_and_reports_what_became_of_it() -> None:
    store = InMemoryStore()
    kafka = StubPublisher(
        lambda m: (
            (Verdict.RETRIABLE, "REQUEST_TIMED_OUT: x") if m.key == b"c" else Verdict.DELIVERED
        )
    )
    enqueue(store, "a", 3)
    store.append("b", "t", b"not an envelope")
    enqueue(store, "c", 1)
    report = relay_on_fakes(store, kafka).drain()
    assert (report.sent, report.delivered, report.discarded, report.retried) == (4, 3, 1, 1)
    assert [e.status for e in store.events()] == ["delivered"] * 3 + ["discarded", "pending"]
    assert store.remaining().pending == 1  # c, waiting for its retry


def test_drain_over_many_batches_sends_each_event_once_in_key_order() -> None:
    store, kafka = InMemoryStore(), StubPublisher()
    keys = [f"k{i:02}" for i in range(12)]
    ids = {key: enqueue(store, key, 3) for key in keys}
    report = relay_on_fakes(store, kafka, batch_size=4).drain()
    assert report.delivered == 36 and len(kafka.sends) > 3
    for key in keys:
        assert [m.event_id for m in kafka.messages() if m.key == key.encode()] == ids[key]
    left = store.remaining()
    assert (left.pending, left.leased) == (0, 0)  # no claim read ahead is left leased


# ------------------------------------------------------------------------ the record step


def test_a_record_that_fails_with_a_storage_error_is_retried_and_loses_nothing() -> None:
    store, kafka, heard = _SlowRecords(failures=2), StubPublisher(), _Announcements()
    ids = enqueue(store, "a", 2) + enqueue(store, "b", 1)
    report = relay_on_fakes(store, kafka, [heard]).drain()
    assert heard.said("database_retry") == ["connection reset by peer"] * 2
    assert report.delivered == 3
    assert [e.status for e in store.events()] == ["delivered"] * 3
    assert sorted(m.event_id for m in kafka.messages()) == sorted(ids)  # each sent once


def test_a_record_keeps_retrying_after_stop_until_the_shutdown_deadline() -> None:
    stopping = threading.Event()
    stopping.set()
    past_deadline = threading.Event()
    db = DatabaseRetry(stopping, past_deadline.is_set, RelayObserver())
    attempts: list[int] = []

    def record() -> str:
        attempts.append(1)
        if len(attempts) < 3:
            raise StorageError("connection refused")
        return "recorded"

    # Kafka has the messages: a stopping relay still records them ...
    assert db.run(record, stop_on_shutdown=False) == "recorded"
    assert len(attempts) == 3
    # ... while a claim, or a record past the deadline, gives up at once.
    attempts.clear()
    with pytest.raises(StorageError):
        db.run(record, stop_on_shutdown=True)
    past_deadline.set()
    with pytest.raises(StorageError):
        db.run(record, stop_on_shutdown=False)
    assert len(attempts) == 2


# ------------------------------------------------------------------------ run and stop


def test_stop_from_another_thread_ends_run_once_the_batch_in_flight_is_recorded() -> None:
    store, kafka = _SlowRecords(seconds=0.3), _HeldSend()
    enqueue(store, "a", 2)
    with running_relay(relay_on_fakes(store, kafka, listen=False)) as thread:
        assert kafka.sending.wait(10)
        thread.relay.stop()  # while the batch is with the broker
        kafka.release.set()
        thread.stop(timeout=10)
        assert not thread.is_alive() and thread.error is None
    assert [e.status for e in store.events()] == ["delivered", "delivered"]
    assert len(kafka.sends) == 1


# ------------------------------------------------------------------------ announcements


def test_observers_hear_each_batch_claimed_settled_key_by_key_sent_then_recorded() -> None:
    store, heard = InMemoryStore(), _Announcements()
    enqueue(store, "a", 2)
    enqueue(store, "b", 1)
    relay_on_fakes(store, StubPublisher(), [heard]).drain()
    assert heard.heard == [
        ("claimed", ["a", "b"]),
        ("settled", ("a", 2)),
        ("settled", ("b", 1)),
        ("sent", ["a", "b"]),
        ("recorded", 3),
    ]


# ------------------------------------------------------------------------ side loops


def test_a_supervised_loop_announces_a_failing_step_and_goes_on_until_stopped() -> None:
    heard = _Announcements()
    steps = threading.Semaphore(0)

    def step() -> None:
        steps.release()
        raise RuntimeError("purge broke")

    loop = SupervisedLoop("purge", step, lambda: 0.01, heard).start()
    try:
        for _ in range(3):  # the loop lives on after each failure
            assert steps.acquire(timeout=5)
        assert loop.alive
    finally:
        loop.stop()
    assert not loop.alive
    assert heard.said("background_failed")[:3] == [("purge", "purge broke")] * 3
