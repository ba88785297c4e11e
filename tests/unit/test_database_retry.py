"""When a relay loop counts as waiting for its database (a multi-outbox relay's liveness)."""

from __future__ import annotations

import threading
import time

import pytest
from prometheus_client import CollectorRegistry

from outbox_kafka.errors import StorageError
from outbox_kafka.relay import loop as relay_loop
from outbox_kafka.relay.loop import DatabaseRetry
from outbox_kafka.relay.metrics import RelayMetrics


def _retry() -> DatabaseRetry:
    return DatabaseRetry(threading.Event(), lambda: False, RelayMetrics(CollectorRegistry()))


def _wait_for(condition: object, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return True
        time.sleep(0.01)
    return False


def test_a_step_that_hangs_counts_as_waiting_and_stops_counting_when_it_ends(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay_loop, "SLOW_STEP_SECONDS", 0.05)
    db = _retry()
    release = threading.Event()
    step = threading.Thread(target=db.run, args=(release.wait,), kwargs={"stop_on_shutdown": True})
    step.start()
    try:
        assert _wait_for(lambda: db.waiting)
    finally:
        release.set()
        step.join(5)
    assert not db.waiting


def test_a_failing_step_counts_as_waiting_until_it_succeeds() -> None:
    db = _retry()
    seen: list[bool] = []
    calls = 0

    def flaky() -> str:
        nonlocal calls
        calls += 1
        seen.append(db.waiting)
        if calls < 3:
            raise StorageError("connection refused")
        return "done"

    assert db.run(flaky, stop_on_shutdown=True) == "done"
    assert seen == [False, True, True]
    assert not db.waiting
