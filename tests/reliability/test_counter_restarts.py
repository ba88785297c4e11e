"""A key whose counter retention deleted starts again at 1: the windows around that.

Each window is opened with a transaction held open on a second connection,
never with timing: a requeue under way when the purge looks at the key, and a
REPEATABLE READ or SERIALIZABLE writer whose snapshot still shows the counter
the purge deletes (deleted and committed, or deleted by a purge that has not
committed yet).
"""

from __future__ import annotations

import threading

import pytest
import sqlalchemy as sa

from outbox_kafka import Event, Outbox
from outbox_kafka.naming import TableNames
from outbox_kafka.operations import Selection, check_consistency, purge
from outbox_kafka.schema.statements import pg_array, pg_int_array, pg_text_array, queries_for
from tests.relay_support import rows, scalar, wait_until

KEY = "k-restart"
OUTBOX = Outbox(allow_unknown_types=True)
Q = queries_for(TableNames())


def _enqueue(conn: sa.Connection, count: int) -> list[str]:
    events = [Event(type="t.e", key=KEY, data={"n": n}, topic="t") for n in range(count)]
    return [str(i) for i in OUTBOX.enqueue_many(conn, events)]


def _done(engine: sa.Engine, statuses: dict[int, str]) -> None:
    """What relays leave behind: events delivered or discarded an hour ago, the key
    out of the queue."""
    with engine.begin() as conn:
        for seq, status in statuses.items():
            conn.execute(
                sa.text(
                    "UPDATE outbox SET status = :status, last_error = 'test', "
                    "created_at = now() - interval '1 hour', "
                    "delivered_at = CASE WHEN :status = 'delivered' "
                    "THEN now() - interval '1 hour' END "
                    "WHERE ordering_key = :key AND seq = :seq"
                ),
                {"status": status, "key": KEY, "seq": seq},
            )
        conn.execute(sa.text("DELETE FROM outbox_arrivals"))
        conn.execute(sa.text("DELETE FROM outbox_keys"))


def _counter(engine: sa.Engine) -> int | None:
    found = rows(engine, "SELECT last_seq FROM outbox_key_seq WHERE ordering_key = :k", k=KEY)
    return int(found[0][0]) if found else None


def _seq(engine: sa.Engine, event_id: str) -> int:
    return int(scalar(engine, "SELECT seq FROM outbox WHERE event_id = :i", i=event_id))


@pytest.mark.parametrize("discarded_seq", [1, 2])
def test_a_requeue_under_way_keeps_the_key_counting_on(
    engine: sa.Engine, discarded_seq: int
) -> None:
    """The purge removes the key's other event meanwhile (the last one, or an
    earlier one) and must not forget the counter: the requeued event comes back
    as the key's next, and a new event after it."""
    with engine.begin() as conn:
        ids = _enqueue(conn, 2)
    _done(engine, {1: "delivered", 2: "delivered", discarded_seq: "discarded"})
    requeued = ids[discarded_seq - 1]

    requeue = engine.connect()
    try:
        with requeue.begin():
            # operations.requeue's statements, its transaction held open.
            event_ids = {"event_ids": pg_array([requeued])}
            selection = Selection(event_ids=(requeued,)).params()
            candidates = requeue.execute(Q["requeue_candidates"], selection).all()
            assert [c.event_id for c in candidates] == [requeued]
            requeue.execute(Q["requeue_queue_rows"], event_ids)
            requeue.execute(Q["lock_keys"], {"ordering_keys": pg_array([KEY])})
            assert requeue.execute(Q["requeue_events"], event_ids).one().requeued == 1
            result = purge(engine, retain_delivered_seconds=0, retain_discarded_seconds=0)
            assert (result.delivered, result.discarded) == (1, 0)
            assert _counter(engine) == 2
    finally:
        requeue.close()

    with engine.begin() as conn:
        [later] = _enqueue(conn, 1)
    assert _seq(engine, later) == 3
    assert rows(engine, "SELECT ordering_key, next_seq FROM outbox_keys") == [(KEY, discarded_seq)]
    assert check_consistency(engine).ok


def _purge_statements(conn: sa.Connection) -> None:
    """The relay's purge transaction (retention.purge_old_events), not committed."""
    purged = conn.execute(Q["purge_delivered"], {"older_than_seconds": 0, "batch": 1000}).all()
    conn.execute(
        Q["forget_idle_counters"],
        {
            "key_names": pg_text_array([r.ordering_key for r in purged]),
            "seqs": pg_int_array(r.seq for r in purged),
        },
    )


@pytest.mark.parametrize("purge_committed", [True, False], ids=["committed", "under_way"])
@pytest.mark.parametrize("level", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_writer_whose_snapshot_predates_the_purge_starts_the_key_again(
    engine: sa.Engine, level: str, purge_committed: bool
) -> None:
    """No serialization error: the writer inserts a new counter (it updates no row
    that changed after its snapshot), and its event is the key's first again."""
    with engine.begin() as conn:
        _enqueue(conn, 3)
    _done(engine, {1: "delivered", 2: "delivered", 3: "delivered"})

    writer = engine.connect().execution_options(isolation_level=level)
    purger = engine.connect()
    written: list[str] = []
    failed: list[BaseException] = []

    def write() -> None:
        try:
            written.extend(_enqueue(writer, 1))
            writer.commit()
        except BaseException as exc:
            failed.append(exc)

    try:
        writer.begin()
        seen = writer.execute(
            sa.text("SELECT last_seq FROM outbox_key_seq WHERE ordering_key = :k"), {"k": KEY}
        ).scalar_one()
        assert seen == 3  # the snapshot is taken, with the counter in it
        purger.begin()
        _purge_statements(purger)
        if purge_committed:
            purger.commit()
            write()
        else:
            pid = writer.execute(sa.text("SELECT pg_backend_pid()")).scalar_one()
            thread = threading.Thread(target=write, daemon=True)
            thread.start()
            wait_until(
                lambda: (
                    scalar(
                        engine, "SELECT wait_event_type FROM pg_stat_activity WHERE pid = :p", p=pid
                    )
                    == "Lock"
                ),
                10,
                interval=0.02,
                what="the writer waiting for the purge's transaction",
            )
            purger.commit()
            thread.join(10)
            assert not thread.is_alive()
    finally:
        writer.close()
        purger.close()

    assert not failed, failed
    [event_id] = written
    assert _seq(engine, event_id) == 1
    assert _counter(engine) == 1
    assert rows(engine, "SELECT ordering_key, first_seq FROM outbox_arrivals") == [(KEY, 1)]
    assert scalar(engine, "SELECT count(*) FROM outbox WHERE ordering_key = :k", k=KEY) == 1
    assert check_consistency(engine).ok
