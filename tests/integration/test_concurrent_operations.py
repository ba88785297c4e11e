"""Operators, relays and writers at once: each race opened deterministically.

Every window is held open by a lock that a second connection holds, not by
timing: the test waits until the statement under test is seen waiting for
that lock in ``pg_stat_activity``, does the conflicting action, then lets go.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import sqlalchemy as sa

from outbox_kafka import Event
from outbox_kafka.database import make_engine
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import Selection, purge, requeue
from outbox_kafka.store import Store
from tests.relay_support import enqueue_bulk, rows, scalar, topic_outbox

KEY = "k-race"
#: The advisory lock the claim's hooked now() waits for.
HOOK_LOCK = 4216
HOOK_SCHEMA = "claim_hook"


def _events(engine: sa.Engine, topic: str, count: int) -> list[str]:
    events = [Event(type="t.e", key=KEY, data={"n": n}, topic=topic) for n in range(count)]
    return enqueue_bulk(engine, topic_outbox(), events)


def _discard_first(engine: sa.Engine, event_id: str) -> None:
    """The state a relay in continue mode leaves: seq 1 discarded, the key moved on to seq 2."""
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


def _wait_for_waiters(engine: sa.Engine, query_like: str, count: int = 1) -> None:
    """Until ``count`` sessions run a statement matching ``query_like`` and wait for a lock."""

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
    while waiting() < count:
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

    def result(self, timeout: float = 30.0) -> Any:
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "the call did not finish"
        if self._error is not None:
            raise self._error
        return self._value


@pytest.fixture
def hooked_store(engine: sa.Engine, database_url: str) -> Iterator[Store]:
    """A relay store whose statements' now() first waits for advisory lock HOOK_LOCK.

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
    store = Store(database_url, TableNames(), engine=hooked)
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
        _wait_for_waiters(engine, "%FOR UPDATE OF k%")
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


def test_purge_leaves_an_event_that_a_requeue_made_pending_while_purge_waited(
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
        _wait_for_waiters(engine, "%FOR UPDATE OF k%")
        # The purge selects the event as discarded and waits for the requeue's lock.
        purged = _InThread(
            lambda: purge(engine, retain_delivered_seconds=0, retain_discarded_seconds=0)
        )
        _wait_for_waiters(engine, "%DELETE FROM%discarded%")
        release_key()
        assert requeued.result().count == 1
        result = purged.result()

    assert result.discarded == 0
    assert rows(engine, "SELECT status, seq FROM outbox WHERE event_id = :id", id=first) == [
        ("pending", 1)
    ]
    assert scalar(engine, "SELECT next_seq FROM outbox_keys WHERE ordering_key = :k", k=KEY) == 1
