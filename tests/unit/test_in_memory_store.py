"""InMemoryStore's claim: the keys it takes, their share of the batch, and its byte budget,
as claim_keys and claim_events do them (tests/integration/test_claim_fairness.py holds
the two side by side)."""

from __future__ import annotations

from outbox_kafka import Event
from outbox_kafka.relay import Relay
from outbox_kafka.relay.batch import Claim, EventOutcome, EventStatus, KeyOutcome, Verdict
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.testing import InMemoryStore, StubPublisher


class _Clock:
    """Time that passes only when told."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def tick(self) -> None:
        self.now += 1.0


def _store() -> tuple[InMemoryStore, _Clock]:
    clock = _Clock()
    return InMemoryStore(clock=clock), clock


def _shape(claim: Claim) -> dict[str, tuple[list[int], bool]]:
    return {k.key: ([e.seq for e in k.events], k.withheld) for k in claim.keys}


def _claim(store: InMemoryStore, max_bytes: int, **kwargs: int) -> Claim:
    return store.claim(
        batch_size=kwargs.pop("batch_size", 1000), lease_seconds=30, max_bytes=max_bytes, **kwargs
    )


def test_the_budget_goes_round_robin_over_the_keys_in_their_due_order() -> None:
    """Four keys with three events of 10 kB each and a 25 kB budget: the first events
    of the three keys due first come, and every key keeps the rest, marked withheld
    (the same claim as PostgreSQL's in test_the_claim_budget_goes_round_robin_over_the_keys)."""
    store, clock = _store()
    for key in ["d", "a", "c", "b"]:
        clock.tick()
        for _ in range(3):
            store.append(key, "t", b"x" * 10_000)
    assert _shape(_claim(store, 25_000)) == {
        "a": ([1], True),
        "b": ([], True),
        "c": ([1], True),
        "d": ([1], True),
    }


def test_keys_due_at_the_same_time_take_their_turns_by_name() -> None:
    store, _ = _store()
    for key in ["b", "a"]:
        store.append(key, "t", b"x" * 10_000)
    assert _shape(_claim(store, 5_000)) == {"a": ([1], False), "b": ([], True)}


def test_the_first_event_comes_whatever_its_size_and_nothing_starts_past_the_budget() -> None:
    store, _ = _store()
    store.append("k", "t", b"x" * 100_000)
    store.append("k", "t", b"x" * 10)
    claim = _claim(store, 1_000)
    assert _shape(claim) == {"k": ([1], True)}
    assert claim.event_count == 1


def test_an_event_is_left_out_when_the_bytes_before_it_reach_the_budget() -> None:
    """Values and headers count (a header as its name and value); an event that starts
    before the budget ends comes whole, one that starts at it does not."""
    store, _ = _store()
    store.append("k", "t", b"x" * 90, [("h", b"123456789")])  # 100 bytes
    store.append("k", "t", b"x" * 50)
    store.append("k", "t", b"x" * 50)
    assert _shape(_claim(store, 101)) == {"k": ([1, 2], True)}
    exact, _ = _store()
    exact.append("k", "t", b"x" * 90, [("h", b"123456789")])
    exact.append("k", "t", b"x" * 50)
    assert _shape(_claim(exact, 100)) == {"k": ([1], True)}


def test_within_the_budget_every_key_gets_its_share_of_the_batch() -> None:
    store, clock = _store()
    for key in ["a", "b", "c"]:
        clock.tick()
        for _ in range(5):
            store.append(key, "t", b"{}")
    claim = _claim(store, 1 << 20, batch_size=6, max_keys=2)
    assert claim.per_key_limit == 3
    assert _shape(claim) == {"a": ([1, 2, 3], False), "b": ([1, 2, 3], False)}


def test_a_key_handed_back_unchanged_keeps_its_place_in_the_queue() -> None:
    """``a`` came first and took the budget; ``z``, withheld, is handed back as it was
    and goes before ``a``, whose batch was recorded after ``z`` became due."""
    store, clock = _store()
    clock.tick()
    store.append("a", "t", b"x" * 10_000)
    store.append("a", "t", b"x" * 10_000)
    clock.tick()
    store.append("z", "t", b"x" * 10_000)
    clock.tick()
    first = _claim(store, 5_000)
    assert _shape(first) == {"a": ([1], True), "z": ([], True)}
    z = next(k for k in first.keys if k.key == "z")
    clock.tick()
    store.record(
        first.token,
        [KeyOutcome("a", 1, 0.0, False, False), KeyOutcome.unchanged(z)],
        [],
    )
    clock.tick()
    assert _shape(_claim(store, 5_000)) == {"a": ([], True), "z": ([1], False)}


def test_the_relay_on_the_fakes_sends_a_key_committed_first_before_a_hot_one() -> None:
    """``z`` commits one event, then ``a`` forty, each larger than the budget: ``z``
    goes first, not after all of ``a``."""
    store, clock = _store()
    kafka = StubPublisher()
    outbox = store.outbox(allow_unknown_types=True)
    clock.tick()
    outbox.enqueue(None, type="t.e", key="z", topic="t", data={"pad": "x" * 2_000})
    clock.tick()
    outbox.enqueue_many(
        None,
        [
            Event(type="t.e", key="a", topic="t", data={"n": n, "pad": "x" * 2_000})
            for n in range(40)
        ],
    )
    settings = RelaySettings(
        database_url="postgresql://unused/db",
        bootstrap_servers="unused:1",
        max_claim_bytes=1_000,
    )
    relay = Relay(settings, store=store, publisher=kafka)
    try:
        report = relay.drain()
    finally:
        relay.close()
    assert report.delivered == 41
    order = [m.key for m in kafka.messages("t")]
    assert order.index(b"z") == 0
    assert max(len(send) for send in kafka.sends) == 1


def test_retention_keeps_a_key_counting_while_any_event_of_it_is_left() -> None:
    # Found by the model checker: numbering from the last event left made a new
    # event's number one the key had already passed, so it was never claimed.
    store, clock = _store()
    first, second = store.append("k", "t", b"{}"), store.append("k", "t", b"{}")
    claim = store.claim(batch_size=10, lease_seconds=30)
    store.record(
        claim.token,
        [KeyOutcome("k", 3, 0.0, False, True)],
        [
            EventOutcome(first.event_id, "k", EventStatus.DISCARDED, 1, 0.0, None, None, "no"),
            EventOutcome(second.event_id, "k", EventStatus.DELIVERED, 0, 0.0, 0, 0, None),
        ],
    )
    clock.tick()
    assert store.purge(delivered_seconds=0.0, discarded_seconds=1e9, batch=100) == 1
    assert [e.status for e in store.events("k")] == [EventStatus.DISCARDED]
    assert store.append("k", "t", b"{}").seq == 3


def test_requeue_and_unpark_do_what_the_operator_commands_do() -> None:
    store, kafka = (
        InMemoryStore(),
        StubPublisher(
            answer=lambda m: Verdict.PERMANENT if b'"bad"' in m.value else Verdict.DELIVERED
        ),
    )
    outbox = store.outbox(source="/t", allow_unknown_types=True)
    settings = RelaySettings(
        database_url="postgresql://u/db", bootstrap_servers="u:1", listen=False, on_exhausted="park"
    )
    for data in ({"bad": 1}, {"ok": 1}):
        outbox.enqueue_many(None, [Event(type="x.y", key="k", topic="t", data=data)])
        Relay(settings, store=store, publisher=kafka).drain()
    assert store.parked_keys() == ["k"] and kafka.messages() == []
    assert store.unpark(["k"]) == 1
    Relay(settings, store=store, publisher=kafka).drain()
    assert [e.status for e in store.events("k")] == ["discarded", "delivered"]
    kafka.answer = lambda m: Verdict.DELIVERED
    assert store.requeue([store.events("k")[0].event_id]) == 1
    Relay(settings, store=store, publisher=kafka).drain()
    assert [e.status for e in store.events("k")] == ["delivered", "delivered"]


def test_claimable_at_is_when_a_claim_takes_the_key_next() -> None:
    store, clock = _store()
    assert store.claimable_at("k") is None  # no such key
    store.append("k", "t", b"x", delay=5.0)
    at = store.claimable_at("k")
    assert at == 5.0
    clock.now = at - 0.5
    assert _claim(store, 1 << 20).keys == []
    clock.now = at
    claim = _claim(store, 1 << 20)
    assert [k.key for k in claim.keys] == ["k"]
    # Leased: not before the lease ends, however the key was due.
    assert store.claimable_at("k") == at + 30
    clock.now = at + 29.5
    assert _claim(store, 1 << 20).keys == []
    # Recorded with a delay: the delay from the record, the lease gone.
    store.record(claim.token, [KeyOutcome("k", 1, 7.0, False, False)], [])
    assert store.claimable_at("k") == at + 29.5 + 7.0
    # Parked: no claim takes it, whatever the time.
    clock.now = at + 40
    store.record(_claim(store, 1 << 20).token, [KeyOutcome("k", 1, 0.0, True, False)], [])
    assert store.claimable_at("k") is None
    clock.now = at + 1000
    assert _claim(store, 1 << 20).keys == []
