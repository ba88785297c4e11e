"""Fairness under the claim's byte budget: a key the budget leaves out keeps its place.

Keys take turns in the order they became due, and the budget is shared out in
that order (docs/explanation/guarantees.md, "Fairness"). The store-level
tests run against PostgreSQL and the in-memory fake alike: the fake is held to
the real thing.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
import sqlalchemy as sa

from outbox_kafka import Event
from outbox_kafka.relay import Relay
from outbox_kafka.relay.batch import Claim, EventOutcome, EventStatus, KeyOutcome
from outbox_kafka.relay.ports import ClaimStore
from outbox_kafka.relay.store import Store
from outbox_kafka.testing import InMemoryStore
from tests.relay_support import (
    consume_all,
    delivered_count,
    enqueue_bulk,
    make_settings,
    outbox_summary,
    running_relay,
    scalar,
    topic_outbox,
    wait_until,
)

NAMES = make_settings("postgresql://unused/db", "unused:1").names

#: Each event's value is larger than every budget below: a claim brings one event.
PAD = 2_000
BUDGET = 1_000


def _events(topic: str, key: str, count: int) -> list[Event]:
    return [
        Event(type="t.e", key=key, data={"n": n, "pad": "x" * PAD}, topic=topic)
        for n in range(count)
    ]


# --------------------------------------------------------------------------- the relay


def test_an_event_committed_before_a_hot_key_goes_first_whatever_the_key_names(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """``z`` commits one event, then ``a`` forty, each larger than the claim budget.
    The first claim takes both keys and gives its budget to the key due first:
    ``z`` is the first message, not the forty-first."""
    topic = new_topic(1)
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, _events(topic, "z", 1))
    enqueue_bulk(engine, outbox, _events(topic, "a", 40))
    relay = Relay(make_settings(database_url, kafka_bootstrap, max_claim_bytes=BUDGET))
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert (report.delivered, report.discarded) == (41, 0)
    order = [r.key for r in consume_all(kafka_bootstrap, topic, 41)]
    assert order.index("z") == 0, f"z came after {order.index('z')} events of a"
    assert [r for r in order if r == "a"] == ["a"] * 40


def test_a_key_that_never_runs_dry_does_not_starve_one_committed_while_it_is_sent(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """A writer keeps ``a`` fifty events ahead of the relay, each larger than the
    budget, for as long as the test runs; ``z`` commits one event meanwhile. At
    most two more events of ``a`` reach Kafka before ``z``: the one a claim
    already held when ``z`` committed, and one from the claim that first sees
    ``z``, when ``a``'s turn came before ``z`` became due. The budget then
    leaves ``z`` out, and it keeps its place for the next claim."""
    topic = new_topic(1)
    outbox = topic_outbox()
    enqueue_bulk(engine, outbox, _events(topic, "a", 50))
    stop_writing = threading.Event()
    writer_errors: list[BaseException] = []

    def keep_a_busy() -> None:
        try:
            while not stop_writing.is_set():
                waiting = scalar(
                    engine,
                    "SELECT count(*) FROM outbox WHERE ordering_key = 'a' AND status = 'pending'",
                )
                if waiting < 50:
                    enqueue_bulk(engine, outbox, _events(topic, "a", 10))
                else:
                    time.sleep(0.002)
        except BaseException as exc:
            writer_errors.append(exc)
            raise

    writer = threading.Thread(target=keep_a_busy, name="writer", daemon=True)
    relay = Relay(
        make_settings(database_url, kafka_bootstrap, max_claim_bytes=BUDGET, batch_size=10)
    )
    writer.start()
    try:
        with running_relay(relay) as thread:
            wait_until(lambda: delivered_count(engine) >= 5, 30, what="a's first events")
            enqueue_bulk(engine, outbox, _events(topic, "z", 1))
            # Every event recorded delivered by now went out before z committed.
            before = delivered_count(engine)

            def z_delivered() -> bool:
                status = scalar(engine, "SELECT status FROM outbox WHERE ordering_key = 'z'")
                return bool(status == "delivered")

            wait_until(
                z_delivered,
                15,
                what="z's event, committed behind a key that never runs dry",
                explain=lambda: outbox_summary(engine),
            )
            stop_writing.set()
            thread.stop()
        assert thread.error is None
    finally:
        stop_writing.set()
        writer.join(30)
        relay.close()
    assert not writer_errors
    delivered = delivered_count(engine)
    order = [r.key for r in consume_all(kafka_bootstrap, topic, delivered)]
    assert order.index("z") <= before + 2, (
        f"z came after {order.index('z')} events of a; {before} were recorded when z committed"
    )


# --------------------------------------------------------------------------- the stores


@dataclass
class _Outbox:
    """A store with a way to add events to it and let time pass."""

    store: ClaimStore
    add: Callable[[str, int], None]
    later: Callable[[], None]


def _postgresql(request: pytest.FixtureRequest) -> Iterator[_Outbox]:
    engine: sa.Engine = request.getfixturevalue("engine")
    database_url: str = request.getfixturevalue("database_url")
    outbox = topic_outbox()
    store = Store(database_url, NAMES)

    def add(key: str, count: int) -> None:
        # One transaction per call: the key becomes due at its now().
        enqueue_bulk(engine, outbox, _events("t", key, count))

    try:
        yield _Outbox(store, add, lambda: None)
    finally:
        store.close()


def _memory(request: pytest.FixtureRequest) -> Iterator[_Outbox]:
    ticks = itertools.count(1)
    now = [0.0]

    def later() -> None:
        now[0] = float(next(ticks))

    store = InMemoryStore(clock=lambda: now[0])
    outbox = topic_outbox()

    def add(key: str, count: int) -> None:
        later()
        for event in _events("t", key, count):
            store.enqueue(outbox, event)

    yield _Outbox(store, add, later)


@pytest.fixture(params=["postgresql", "memory"])
def outbox_store(request: pytest.FixtureRequest) -> Iterator[_Outbox]:
    """The real store on a fresh database, and the in-memory fake: the same assertions hold."""
    yield from (_postgresql if request.param == "postgresql" else _memory)(request)


def _claim(outbox: _Outbox) -> Claim:
    outbox.later()
    return outbox.store.claim(batch_size=100, lease_seconds=30, max_keys=None, max_bytes=BUDGET)


def _shape(claim: Claim) -> dict[str, tuple[list[int], bool]]:
    return {k.key: ([e.seq for e in k.events], k.withheld) for k in claim.keys}


def test_the_budget_goes_to_the_key_due_first(outbox_store: _Outbox) -> None:
    """``z`` became due before ``a``: its event comes, ``a``'s wait (not the other
    way round, as key names would have it)."""
    outbox_store.add("z", 1)
    outbox_store.add("a", 3)
    assert _shape(_claim(outbox_store)) == {"a": ([], True), "z": ([1], False)}


def test_a_key_the_budget_withheld_is_first_at_the_next_claim(outbox_store: _Outbox) -> None:
    """``a`` became due first and takes the budget; ``z``, withheld, is handed back
    as it was and keeps its place: the next claim gives it the budget, although
    ``a`` was recorded back in the same statement."""
    outbox_store.add("a", 3)
    outbox_store.add("z", 1)
    first = _claim(outbox_store)
    assert _shape(first) == {"a": ([1], True), "z": ([], True)}
    a, z = sorted(first.keys, key=lambda k: k.key)
    outbox_store.later()
    result = outbox_store.store.record(
        first.token,
        [KeyOutcome("a", 2, 0.0, False, False), KeyOutcome.unchanged(z)],
        [EventOutcome(a.events[0].event_id, "a", EventStatus.DELIVERED, 0, 0.0, 0, 0, None)],
    )
    assert (result.keys_owned, result.delivered) == (2, 1)
    assert _shape(_claim(outbox_store)) == {"a": ([], True), "z": ([1], False)}
