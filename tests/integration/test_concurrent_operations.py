"""Operators, relays and writers at once: each race opened deterministically.

Every window is held open by a lock that a second connection holds, not by
timing: the test waits until the statement under test is seen waiting for
that lock in ``pg_stat_activity``, does the conflicting action, then lets go.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_kafka import Event
from outbox_kafka.database import make_engine
from outbox_kafka.errors import InvalidSelection
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import Selection, check_consistency, purge, requeue
from outbox_kafka.relay import Relay
from outbox_kafka.relay.batch import EventOutcome, KeyOutcome, Verdict
from outbox_kafka.relay.config import RelaySettings
from outbox_kafka.relay.metrics import Monitor
from outbox_kafka.relay.ports import Delivery, Message
from outbox_kafka.relay.send import Publisher
from outbox_kafka.relay.store import Store
from tests.relay_support import (
    admit_arrivals,
    consume_all,
    enqueue_bulk,
    make_settings,
    per_key_order,
    rows,
    scalar,
    topic_outbox,
)

KEY = "k-race"
#: The advisory lock the claim's hooked now() waits for.
HOOK_LOCK = 4216
HOOK_SCHEMA = "claim_hook"


def _events(engine: sa.Engine, topic: str, count: int) -> list[str]:
    events = [Event(type="t.e", key=KEY, data={"n": n}, topic=topic) for n in range(count)]
    return enqueue_bulk(engine, topic_outbox(), events)


def _discard_first(engine: sa.Engine, event_id: str) -> None:
    """The state a relay in continue mode leaves: seq 1 discarded, the key moved on to seq 2."""
    admit_arrivals(engine)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'discarded', attempts = 1, last_error = 'test' "
                "WHERE event_id = :id"
            ),
            {"id": event_id},
        )
        conn.execute(
            sa.text("UPDATE outbox_keys SET next_seq = 2, due_at = now() - interval '1 s'")
        )


def _wait_for_waiters(
    engine: sa.Engine,
    query_like: str,
    count: int = 1,
    *,
    unless: Callable[[], bool] = lambda: False,
) -> None:
    """Until ``count`` sessions run a statement matching ``query_like`` and wait for a lock
    (or ``unless()`` is true)."""

    def waiting() -> int:
        return int(
            scalar(
                engine,
                "SELECT count(*) FROM pg_stat_activity "
                "WHERE datname = current_database() AND wait_event_type = 'Lock' "
                "AND query LIKE :pattern",
                pattern=query_like,
            )
        )

    deadline = 200
    while waiting() < count and not unless():
        deadline -= 1
        assert deadline > 0, f"no session ran {query_like!r} and waited for a lock"
        threading.Event().wait(0.05)


@contextlib.contextmanager
def _held(engine: sa.Engine, sql: str, **params: Any) -> Iterator[Callable[[], None]]:
    """Run ``sql`` in a transaction kept open until the yielded release() is called."""
    conn = engine.connect()
    tx = conn.begin()
    conn.execute(sa.text(sql), params)
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            tx.commit()
            conn.close()

    try:
        yield release
    finally:
        release()


class _InThread:
    """Run a call in a thread; ``result()`` joins it and returns or raises."""

    def __init__(self, call: Callable[[], Any]) -> None:
        self._value: Any = None
        self._error: BaseException | None = None

        def run() -> None:
            try:
                self._value = call()
            except BaseException as exc:  # handed to result()
                self._error = exc

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()

    def done(self) -> bool:
        return not self._thread.is_alive()

    def result(self, timeout: float = 30.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not finish"
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture
def hooked_engine(engine: sa.Engine, database_url: str) -> Iterator[sa.Engine]:
    """An engine whose statements' now() first waits for advisory lock HOOK_LOCK.

    A schema ahead of pg_catalog in the search path shadows now(); the hook
    runs while the statement executes, after its snapshot was taken, so a
    test holding the lock holds the statement between snapshot and row locks.
    """
    with engine.begin() as conn:
        conn.execute(sa.text(f"CREATE SCHEMA {HOOK_SCHEMA}"))
        conn.execute(
            sa.text(
                f"CREATE FUNCTION {HOOK_SCHEMA}.now() RETURNS timestamptz "
                "LANGUAGE plpgsql VOLATILE AS $$ BEGIN "
                f"PERFORM pg_advisory_lock_shared({HOOK_LOCK}); "
                f"PERFORM pg_advisory_unlock_shared({HOOK_LOCK}); "
                "RETURN pg_catalog.now(); END $$"
            )
        )
    hooked = make_engine(
        database_url,
        connect_args={"options": f"-c search_path={HOOK_SCHEMA},pg_catalog,public"},
    )
    yield hooked
    hooked.dispose()


@pytest.fixture
def hooked_store(database_url: str, hooked_engine: sa.Engine) -> Iterator[Store]:
    """A relay store on :func:`hooked_engine`."""
    store = Store(database_url, TableNames(), engine=hooked_engine)
    yield store
    store.close()


def test_a_requeue_committed_while_a_claim_runs_is_claimed_with_its_key(
    engine: sa.Engine, hooked_store: Store, new_topic: Callable[..., str]
) -> None:
    """Found: the claim locked the key's newest row (next_seq lowered by the requeue)
    but read its events from the statement's older snapshot, where the requeued
    event was still discarded; the relay then sent the later events and moved
    next_seq past the requeued one, stranding it."""
    first, second, third = _events(engine, new_topic(partitions=1), 3)
    _discard_first(engine, first)

    with (
        _held(engine, "SELECT pg_advisory_xact_lock(:id)", id=HOOK_LOCK) as release_hook,
        _held(
            engine, "SELECT 1 FROM outbox_keys WHERE ordering_key = :k FOR UPDATE", k=KEY
        ) as release_key,
    ):
        # The requeue begins first (its now() is older than the claim's) and waits
        # for the key row; the claim then takes its snapshot and waits in now().
        requeued = _InThread(lambda: requeue(engine, Selection(event_ids=(first,))))
        _wait_for_waiters(engine, "%ORDER BY ordering_key\nFOR UPDATE%")
        claiming = _InThread(
            lambda: hooked_store.claim(batch_size=100, lease_seconds=30.0, max_keys=10)
        )
        _wait_for_waiters(engine, "%FOR UPDATE SKIP LOCKED%")
        release_key()
        assert requeued.result().count == 1  # committed while the claim is held
        release_hook()
        claim = claiming.result()

    [key] = claim.keys
    assert key.next_seq == 1
    assert [e.event_id for e in key.events] == [first, second, third]


def test_a_requeue_racing_a_relay_that_parks_the_key_never_skips_the_parking_event(
    engine: sa.Engine, database_url: str, hooked_engine: sa.Engine, new_topic: Callable[..., str]
) -> None:
    """Found in review: the requeue locked the key's newest row (parked by a relay
    meanwhile) but read the event that parked it from its older snapshot, found
    none, and unparked the key without it: the parking event was skipped."""
    first, second, _ = _events(engine, new_topic(partitions=1), 3)
    _discard_first(engine, first)
    token = uuid.uuid4()
    with engine.begin() as conn:  # a relay holds the key, sending the second event
        conn.execute(
            sa.text(
                "UPDATE outbox_keys SET claim_token = :t, "
                "lease_expires_at = now() + interval '30 s'"
            ),
            {"t": str(token)},
        )
    relay = Store(database_url, TableNames())
    try:
        with _held(engine, "SELECT pg_advisory_xact_lock(:id)", id=HOOK_LOCK) as release_hook:
            # The requeue of the first event reads the key's state and waits in now().
            requeued = _InThread(lambda: requeue(hooked_engine, Selection(event_ids=(first,))))
            _wait_for_waiters(engine, "%now()%")
            # Meanwhile the relay records its batch: the second event discarded, the
            # key parked on it (fenced by its claim token, as always).
            parked = _InThread(
                lambda: relay.record(
                    token,
                    [KeyOutcome(KEY, 2, 0.0, True, False)],
                    [EventOutcome(second, KEY, "discarded", 1, 0.0, None, None, "test")],
                )
            )
            threading.Event().wait(0.5)  # the record commits, or waits for the requeue's lock
            release_hook()
            try:
                outcome: Any = requeued.result()
            except InvalidSelection as exc:
                outcome = exc
            recorded = parked.result()
    finally:
        relay.close()

    if isinstance(outcome, InvalidSelection):
        # The requeue saw the park: it refuses a selection without the parking event.
        assert f"parked by event {second}" in str(outcome)
        assert recorded.keys_owned == 1
    else:
        # The requeue took the key from the relay first: the record is fenced off.
        assert (outcome.count, outcome.taken_keys, recorded.keys_owned) == (1, [KEY], 0)
    # Either way no discarded event is left behind the key's next_seq but the one a
    # parked key waits on.
    skipped = rows(
        engine,
        "SELECT e.seq FROM outbox e JOIN outbox_keys k USING (ordering_key) "
        "WHERE e.status = 'discarded' AND e.seq >= k.next_seq "
        "AND NOT (k.parked_at IS NOT NULL AND e.seq = k.next_seq)",
    )
    assert skipped == []
    assert check_consistency(engine).ok


def test_a_requeue_of_a_key_without_a_queue_row_sees_a_park_made_meanwhile(
    engine: sa.Engine, hooked_engine: sa.Engine, new_topic: Callable[..., str]
) -> None:
    """Found in review: for a key with no queue row (all its events done) the requeue
    had nothing to lock; a writer could add the key and a relay park it before the
    requeue wrote, and the requeue then unparked it without the parking event."""
    topic = new_topic(partitions=1)
    [first] = _events(engine, topic, 1)
    admit_arrivals(engine)
    with engine.begin() as conn:  # the relay discarded it; the key left the queue
        conn.execute(
            sa.text("UPDATE outbox SET status = 'discarded', last_error = 'test'"),
        )
        conn.execute(sa.text("DELETE FROM outbox_keys"))

    with _held(engine, "SELECT pg_advisory_xact_lock(:id)", id=HOOK_LOCK) as release_hook:
        requeued = _InThread(lambda: requeue(hooked_engine, Selection(event_ids=(first,))))
        _wait_for_waiters(engine, "%now()%")
        # Meanwhile a writer adds an event of the key, and a relay takes the key in
        # and parks it on that event.
        [second] = _events(engine, topic, 1)
        admit_arrivals(engine)
        with engine.begin() as conn:
            conn.execute(
                sa.text(
                    "UPDATE outbox SET status = 'discarded', last_error = 'test' "
                    "WHERE event_id = :id"
                ),
                {"id": second},
            )
            conn.execute(sa.text("UPDATE outbox_keys SET parked_at = now()"))
        release_hook()
        with pytest.raises(InvalidSelection, match=f"parked by event {second}"):
            requeued.result()

    assert rows(engine, "SELECT next_seq, parked_at IS NOT NULL FROM outbox_keys") == [(2, True)]


def test_purge_leaves_an_event_that_a_requeue_holds(
    engine: sa.Engine, new_topic: Callable[..., str]
) -> None:
    """Found: after waiting for the requeue's row lock, the purge re-checked only its
    outer condition (the event id) and deleted an event the requeue had just made
    pending, leaving its key's next_seq pointing at nothing."""
    first, _, _ = _events(engine, new_topic(partitions=1), 3)
    _discard_first(engine, first)

    with _held(
        engine, "SELECT 1 FROM outbox_keys WHERE ordering_key = :k FOR UPDATE", k=KEY
    ) as release_key:
        # The requeue locks the event, then waits for the key row.
        requeued = _InThread(lambda: requeue(engine, Selection(event_ids=(first,))))
        _wait_for_waiters(engine, "%ORDER BY ordering_key\nFOR UPDATE%")
        # The purge finds the event discarded while the requeue holds it: it skips
        # it, or waits for the lock (and must then see that it is pending).
        purged = _InThread(
            lambda: purge(engine, retain_delivered_seconds=0, retain_discarded_seconds=0)
        )
        _wait_for_waiters(engine, "%DELETE FROM%discarded%", unless=purged.done)
        release_key()
        assert requeued.result().count == 1
        result = purged.result()

    assert result.discarded == 0
    assert rows(engine, "SELECT status, seq FROM outbox WHERE event_id = :id", id=first) == [
        ("pending", 1)
    ]
    assert scalar(engine, "SELECT next_seq FROM outbox_keys WHERE ordering_key = :k", k=KEY) == 1


def test_purge_leaves_an_event_that_a_requeue_made_pending_after_purge_began(
    engine: sa.Engine, hooked_engine: sa.Engine, new_topic: Callable[..., str]
) -> None:
    """The same, with the requeue committed between the purge's snapshot and its lock."""
    first, _, _ = _events(engine, new_topic(partitions=1), 3)
    _discard_first(engine, first)

    with _held(engine, "SELECT pg_advisory_xact_lock(:id)", id=HOOK_LOCK) as release_hook:
        purged = _InThread(
            lambda: purge(hooked_engine, retain_delivered_seconds=0, retain_discarded_seconds=0)
        )
        _wait_for_waiters(engine, "%DELETE FROM%discarded%")
        assert requeue(engine, Selection(event_ids=(first,))).count == 1
        release_hook()
        result = purged.result()

    assert result.discarded == 0
    assert scalar(engine, "SELECT status FROM outbox WHERE event_id = :id", id=first) == "pending"


# --------------------------------------------------------------------------- consistency


def _mixed_outbox(engine: sa.Engine, topic: str) -> dict[str, list[str]]:
    """Three keys with three pending events each; returns their ids by key."""
    events = [
        Event(type="t.e", key=key, data={"n": n}, topic=topic)
        for n in range(3)
        for key in ("a", "b", "c")
    ]
    ids = enqueue_bulk(engine, topic_outbox(), events)
    by_key: dict[str, list[str]] = {}
    for event, event_id in zip(events, ids, strict=True):
        by_key.setdefault(event.key, []).append(event_id)
    return by_key


def _violations(engine: sa.Engine) -> set[tuple[str, str, str | None]]:
    return {(v.check, v.key, v.event_id) for v in check_consistency(engine).violations}


def test_the_consistency_check_finds_nothing_in_an_outbox_left_by_writers_and_relays(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    _mixed_outbox(engine, topic)
    assert check_consistency(engine).ok
    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        relay.cycle()  # part of it sent, the rest pending, keys leased and released
        assert check_consistency(engine).ok
        relay.drain()
    finally:
        relay.close()
    report = check_consistency(engine)
    assert report.ok, report.violations
    assert report.as_dict()["ok"] is True


def test_the_consistency_check_names_each_doctored_key_and_event(
    engine: sa.Engine, database_url: str, new_topic: Callable[..., str]
) -> None:
    ids = _mixed_outbox(engine, new_topic(partitions=1))
    admit_arrivals(engine)
    with engine.begin() as conn:
        # a: its queue row is gone; b: next_seq moved past two pending events.
        conn.execute(sa.text("DELETE FROM outbox_keys WHERE ordering_key = 'a'"))
        conn.execute(sa.text("UPDATE outbox_keys SET next_seq = 3 WHERE ordering_key = 'b'"))
        # c: a lease half set, a counter behind its events, a discard without reason.
        conn.execute(
            sa.text(
                "UPDATE outbox_keys SET claim_token = gen_random_uuid() WHERE ordering_key = 'c'"
            )
        )
        conn.execute(sa.text("UPDATE outbox_key_seq SET last_seq = 2 WHERE ordering_key = 'c'"))
        conn.execute(
            sa.text("UPDATE outbox SET status = 'discarded' WHERE event_id = :id"),
            {"id": ids["c"][0]},
        )

    assert _violations(engine) == {
        *(("unqueued_pending", "a", event_id) for event_id in ids["a"]),
        *(("passed_pending", "b", event_id) for event_id in ids["b"][:2]),
        ("counter_behind", "c", ids["c"][2]),
        ("queue_rows", "c", None),
        ("discarded_without_reason", "c", ids["c"][0]),
    }
    details = {v.check: v.detail for v in check_consistency(engine).violations}
    assert "next_seq 3" in details["passed_pending"]
    assert "claim token and lease expiry" in details["queue_rows"]
    # The relay's sampler counts what it can find cheaply: keys a and b, and c's queue row.
    assert Monitor(engine, TableNames()).consistency_violations(timeout=10) == 3

    limited = check_consistency(engine, limit=1)
    assert limited.truncated["unqueued_pending"] is True
    assert len([v for v in limited.violations if v.check == "unqueued_pending"]) == 1


# --------------------------------------------------------------------------- drain


def test_drain_all_waits_for_the_leases_of_a_relay_that_died_and_then_sends_their_events(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(partitions=2)
    ids = _mixed_outbox(engine, topic)
    dead = Store(database_url, TableNames())
    try:
        held = dead.claim(batch_size=100, lease_seconds=60.0, max_keys=2)  # never recorded
    finally:
        dead.close()
    assert len(held.keys) == 2

    relay = Relay(make_settings(database_url, kafka_bootstrap))
    try:
        short = relay.drain_all(timeout=0.5)
        assert not short.complete
        assert (short.left.pending, short.left.leased) == (6, 6)
        assert "6 on keys another relay still holds a lease on" in short.summary()
        with engine.begin() as conn:  # the dead relay's leases end in a moment
            conn.execute(
                sa.text(
                    "UPDATE outbox_keys SET lease_expires_at = now() + interval '1 s', "
                    "due_at = now() + interval '1 s' WHERE claim_token IS NOT NULL"
                )
            )
        result = relay.drain_all(timeout=30.0)
    finally:
        relay.close()

    assert result.complete, result.summary()
    assert result.summary().endswith("nothing left pending")
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status <> 'delivered'") == 0
    records = consume_all(kafka_bootstrap, topic, 9)
    assert per_key_order(records) == ids


def test_drain_all_reports_parked_keys_without_waiting_for_them(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    ids = _mixed_outbox(engine, new_topic(partitions=1))
    with engine.begin() as conn:
        conn.execute(
            sa.text("UPDATE outbox SET value = 'not json'::bytea WHERE event_id = :id"),
            {"id": ids["a"][0]},
        )
    relay = Relay(make_settings(database_url, kafka_bootstrap, on_exhausted="park"))
    try:
        result = relay.drain_all(timeout=30.0)
    finally:
        relay.close()
    assert not result.complete
    assert (result.left.pending, result.left.parked, result.left.next_due_seconds) == (2, 2, None)
    assert "2 on parked keys" in result.summary()


# --------------------------------------------------------------------------- one key, two topics


class _BrokerRejectsOnce(Publisher):
    """The real publisher, except that the first send of each id in ``reject`` fails as a
    broker's rejection of its record batch would (the rest of the call goes through).

    Records every call: which event ids were handed over together, and which arrived.
    """

    def __init__(self, settings: RelaySettings, reject: set[str]) -> None:
        super().__init__(settings.producer_config(), settings.admin_config())
        self.reject = set(reject)
        self.calls: list[tuple[list[str], set[str]]] = []

    def send(
        self,
        messages: Sequence[Message],
        *,
        timeout: float,
        abort: Callable[[], bool] | None = None,
    ) -> list[Delivery]:
        ids = [m.event_id for m in messages]
        rejected = {i for i in ids if i in self.reject}
        self.reject -= rejected
        passed = [m for m, i in zip(messages, ids, strict=True) if i not in rejected]
        real = iter(super().send(passed, timeout=timeout, abort=abort))
        refused = Delivery(Verdict.RETRIABLE, error="MSG_SIZE_TOO_LARGE: rejected by the broker")
        refused.sent = refused.reported = True
        deliveries = [refused if i in rejected else next(real) for i in ids]
        pairs = zip(ids, deliveries, strict=True)
        self.calls.append((ids, {i for i, d in pairs if d.verdict == Verdict.DELIVERED}))
        return deliveries


def test_a_later_event_of_a_key_waits_while_an_earlier_one_for_another_topic_is_unacknowledged(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """Found: a key's events for two topics went out in one batch; when the broker
    rejected the first, the second was recorded delivered while the first retried."""
    first_topic, second_topic = new_topic(partitions=1), new_topic(partitions=1)
    events = [
        Event(type="t.e", key=KEY, data={"n": 0}, topic=first_topic),
        Event(type="t.e", key=KEY, data={"n": 1}, topic=second_topic),
        Event(type="t.e", key=KEY, data={"n": 2}, topic=first_topic),
    ]
    ids = enqueue_bulk(engine, topic_outbox(), events)
    settings = make_settings(database_url, kafka_bootstrap)
    publisher = _BrokerRejectsOnce(settings, reject={ids[0]})
    relay = Relay(settings, publisher=publisher)
    try:
        for _ in range(40):  # cycles, with the first event's backoff between them
            relay.drain()
            if scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'pending'") == 0:
                break
            threading.Event().wait(0.05)
        violations = [
            relay.metrics.registry.get_sample_value("outbox_order_violations_total", {"topic": t})
            for t in (first_topic, second_topic)
        ]
    finally:
        relay.close()

    arrived_in: dict[str, int] = {}
    for n, (handed_over, arrived) in enumerate(publisher.calls):
        for event_id in handed_over:
            earlier = ids[: ids.index(event_id)]
            missing = [e for e in earlier if arrived_in.get(e) is None]
            assert not missing, (
                f"event {ids.index(event_id)} was handed over in call {n} "
                f"before events {[ids.index(e) for e in missing]} of its key had arrived: "
                f"{publisher.calls}"
            )
        for event_id in arrived:
            arrived_in.setdefault(event_id, n)
    assert set(arrived_in) == set(ids)
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE status = 'delivered'") == 3
    assert violations == [None, None]  # never counted, for either topic
    assert [r.event_id for r in consume_all(kafka_bootstrap, first_topic, 2)] == [ids[0], ids[2]]


def test_a_later_event_taken_while_an_earlier_one_of_its_partition_was_rejected_is_counted(
    engine: sa.Engine, database_url: str, kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    """The case the relay cannot prevent while it keeps a key's batch in flight: a broker
    that rejects one record batch and takes the next on the same partition. It is
    counted and logged, so an operator sees it."""
    topic = new_topic(partitions=1)
    events = [Event(type="t.e", key=KEY, data={"n": n}, topic=topic) for n in range(2)]
    ids = enqueue_bulk(engine, topic_outbox(), events)
    settings = make_settings(database_url, kafka_bootstrap)
    relay = Relay(settings, publisher=_BrokerRejectsOnce(settings, reject={ids[0]}))
    try:
        relay.cycle()
        violations = relay.metrics.registry.get_sample_value(
            "outbox_order_violations_total", {"topic": topic}
        )
    finally:
        relay.close()
    assert violations == 1
