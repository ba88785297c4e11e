"""The relay's announcements (outbox_kafka/relay/observe.py): every subscriber hears the
same story, the metrics count it, and one more subscriber can be given to a Relay."""

from __future__ import annotations

import logging

import pytest
from prometheus_client import CollectorRegistry

from outbox_kafka.relay import Relay, RelayMetrics, RelaySettings
from outbox_kafka.relay.batch import Claim, ClaimedEvent, KeyOutcome, RecordResult
from outbox_kafka.relay.decide import Discard, Retry, Settlement
from outbox_kafka.relay.observe import LogObserver, Observers, RelayObserver
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.testing import InMemoryStore, StubPublisher


class _Recorder(RelayObserver):
    def __init__(self) -> None:
        self.heard: list[str] = []
        self.delivered: list[str] = []
        self.discarded: list[str] = []

    def claimed(self, claim: Claim, seconds: float) -> None:
        self.heard.append("claimed")

    def before_send(self, messages: list[Message]) -> list[Message]:
        self.heard.append(f"before_send {len(messages)}")
        return messages

    def after_send(self, messages: list[Message], deliveries: object) -> None:
        self.heard.append(f"after_send {len(messages)}")

    def sent(self, claim: Claim, seconds: float) -> None:
        self.heard.append("sent")

    def settled(self, settlement: Settlement) -> None:
        self.delivered += [e.event_id for e in settlement.delivered]
        self.discarded += [d.event.event_id for d in settlement.decisions if isinstance(d, Discard)]

    def recorded(self, result: RecordResult, seconds: float) -> None:
        self.heard.append(f"recorded {result.delivered}+{result.discarded}")


def _value(metrics: RelayMetrics, name: str) -> float:
    return sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name == name)


def test_a_relay_given_an_observer_announces_each_step_to_it_and_still_counts() -> None:
    store = InMemoryStore()
    outbox = store.outbox(source="/orders")
    outbox.enqueue(None, type="order.created", key="good", topic="orders", data={"n": 1})
    broken = store.append("bad", "orders", b"not an envelope")
    recorder = _Recorder()
    metrics = RelayMetrics(CollectorRegistry())
    settings = RelaySettings(database_url="postgresql://unused/db", bootstrap_servers="unused:1")
    relay = Relay(settings, store=store, publisher=StubPublisher(), metrics=metrics,
                  observers=[recorder])  # fmt: skip
    report = relay.drain()
    relay.close()
    assert (report.delivered, report.discarded) == (1, 1)
    assert recorder.heard[:4] == ["claimed", "before_send 1", "after_send 1", "sent"]
    assert "recorded 1+1" in recorder.heard
    assert len(recorder.delivered) == 1 and recorder.discarded == [broken.event_id]
    assert _value(metrics, "outbox_events_published_total") == 1
    assert _value(metrics, "outbox_events_discarded_total") == 1
    assert _value(metrics, "outbox_claim_duration_seconds_count") >= 1


def test_observers_hand_each_subscriber_back_the_messages_it_returned() -> None:
    seen: list[tuple[str, list[Message]]] = []

    class Renaming(RelayObserver):
        def __init__(self, name: str) -> None:
            self.name = name

        def before_send(self, messages: list[Message]) -> list[Message]:
            return [m._replace(topic=f"{m.topic}.{self.name}") for m in messages]

        def after_send(self, messages: list[Message], deliveries: object) -> None:
            seen.append((self.name, messages))

    observers = Observers([Renaming("a"), Renaming("b")])
    sending = observers.before_send([Message("t", b"k", b"v", [])])
    observers.after_send(sending, [Delivery()])
    assert [m.topic for m in sending] == ["t.a.b"]
    assert [(name, [m.topic for m in ms]) for name, ms in seen] == [
        ("a", ["t.a"]),
        ("b", ["t.a.b"]),
    ]


class _Broken(RelayObserver):
    """A subscriber with a bug in every announcement it overrides."""

    def before_send(self, messages: list[Message]) -> list[Message]:
        raise RuntimeError("before_send bug")

    def after_send(self, messages: list[Message], deliveries: object) -> None:
        raise RuntimeError("after_send bug")

    def recorded(self, result: RecordResult, seconds: float) -> None:
        raise RuntimeError("recorded bug")


def test_a_subscriber_that_raises_is_reported_and_the_relay_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # An exception from a subscriber given as Relay(observers=) used to end drain()
    # and run() (from the background record: after the batch was sent and recorded).
    store = InMemoryStore()
    outbox = store.outbox(source="/orders")
    for n in range(30):
        outbox.enqueue(None, type="order.created", key=f"k{n % 3}", topic="orders", data={"n": n})
    metrics = RelayMetrics(CollectorRegistry())
    recorder = _Recorder()
    settings = RelaySettings(
        database_url="postgresql://unused/db", bootstrap_servers="unused:1", batch_size=5
    )
    kafka = StubPublisher()
    relay = Relay(settings, store=store, publisher=kafka, metrics=metrics,
                  observers=[_Broken(), recorder])  # fmt: skip
    with caplog.at_level(logging.ERROR, logger="outbox_kafka.relay"):
        report = relay.drain()
    relay.close()
    assert report.delivered == 30 and len(kafka.messages("orders")) == 30
    assert len(recorder.delivered) == 30  # the subscribers after it hear everything
    failed = sorted(
        r.task  # type: ignore[attr-defined]
        for r in caplog.records
        if getattr(r, "action", "") == "background_error"
    )
    # Each failing announcement once: a subscriber failing on every batch is reported
    # at most every OBSERVER_FAILURE_SECONDS.
    assert failed == [
        "observer _Broken.after_send",
        "observer _Broken.before_send",
        "observer _Broken.recorded",
    ]
    assert all(r.exc_info for r in caplog.records if getattr(r, "action", "") == "background_error")
    assert _value(metrics, "outbox_background_errors_total") == 3


def _settlements() -> list[Settlement]:
    """Three keys' settlements: deliveries to two topics, a discard, a retry."""

    def event(key: str, seq: int, topic: str) -> ClaimedEvent:
        return ClaimedEvent(f"{key}-{seq}", key, seq, topic, "t", b"{}", [], 0, True, 0.0)

    a = [event("a", 1, "orders"), event("a", 2, "orders")]
    b = [event("b", 1, "payments")]
    c = [event("c", 1, "orders"), event("c", 2, "orders")]
    return [
        Settlement(KeyOutcome("a", 3, 0.0, False, True), [], a),
        Settlement(
            KeyOutcome("b", 2, 0.0, False, True),
            [],
            [],
            [Discard(b[0], 3, "gave up", "MSG_TIMED_OUT: late")],
        ),
        Settlement(
            KeyOutcome("c", 2, 1.0, False, False),
            [],
            c[:1],
            [Retry(c[1], 1, "REQUEST_TIMED_OUT: slow")],
        ),
    ]


def test_a_batch_of_settlements_counts_as_its_keys_one_by_one() -> None:
    """settled_all: the metrics count a batch at once as they count it key by key, and
    a subscriber that only hears single keys hears each of them."""
    together, one_by_one = RelayMetrics(CollectorRegistry()), RelayMetrics(CollectorRegistry())
    recorder, silent = _Recorder(), RelayObserver()
    Observers([together, recorder, silent]).settled_all(_settlements())
    for settlement in _settlements():
        one_by_one.settled(settlement)
    for name, count in (
        ("outbox_events_published_total", 3),
        ("outbox_events_discarded_total", 1),
        ("outbox_events_retried_total", 1),
    ):
        assert _value(together, name) == _value(one_by_one, name) == count, name
    samples = {
        s.labels.get("topic"): s.value
        for m in together.registry.collect()
        for s in m.samples
        if s.name == "outbox_events_published_total"
    }
    assert samples == {"orders": 3}
    assert recorder.delivered == ["a-1", "a-2", "c-1"]
    assert recorder.discarded == ["b-1"]


def test_a_subscriber_failing_on_one_key_still_hears_the_batch_s_other_keys(
    caplog: pytest.LogCaptureFixture,
) -> None:
    heard: list[str] = []

    class FailsOnB(RelayObserver):
        def settled(self, settlement: Settlement) -> None:
            if settlement.key.key == "b":
                raise RuntimeError("settled bug")
            heard.append(settlement.key.key)

    metrics = RelayMetrics(CollectorRegistry())
    with caplog.at_level(logging.ERROR):
        Observers([FailsOnB(), metrics, LogObserver()]).settled_all(_settlements())
    assert heard == ["a", "c"]
    failed = [r.task for r in caplog.records if getattr(r, "action", "") == "background_error"]  # type: ignore[attr-defined]
    assert failed == ["observer FailsOnB.settled"]
    assert _value(metrics, "outbox_background_errors_total") == 1
    assert _value(metrics, "outbox_events_published_total") == 3
