"""The scenarios' order check: it takes commit order from the writers, and catches a reorder.

A key whose counter retention deleted numbers its next events from 1 again,
so the check cannot compare sequence numbers across a counter's lives: these
tests restart a key for real and plant reorders in what a reader would see.
"""

from __future__ import annotations

import sqlalchemy as sa

from outbox_kafka import Event, Outbox
from outbox_kafka.operations import purge
from tests.reliability.harness import (
    WRITER_COMMIT_ORDER,
    commit_order_violations,
    take_commit_places,
)

OUTBOX = Outbox(allow_unknown_types=True)


def _commit(engine: sa.Engine, keys: list[str], places: dict[str, int]) -> list[str]:
    """One transaction of events for ``keys``, as the operators scenario writes them."""
    with engine.begin() as conn:
        taken = take_commit_places(conn, keys)
        events = [Event(type="t.e", key=k, data={}, topic="t") for k in keys]
        ids = [str(i) for i in OUTBOX.enqueue_many(conn, events)]
    places.update(zip(ids, taken, strict=True))
    return ids


def _deliver_and_purge(engine: sa.Engine) -> None:
    """What a relay and its retention do to an idle key: delivered, purged, counter gone."""
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "UPDATE outbox SET status = 'delivered', "
                "delivered_at = now() - interval '1 hour', kafka_partition = 0, kafka_offset = 0"
            )
        )
        conn.execute(sa.text("DELETE FROM outbox_arrivals"))
        conn.execute(sa.text("DELETE FROM outbox_keys"))
    purge(engine, retain_delivered_seconds=0, retain_discarded_seconds=0)


def _seqs(engine: sa.Engine, ids: list[str]) -> list[int]:
    with engine.connect() as conn:
        found = dict(
            conn.execute(
                sa.text(
                    "SELECT CAST(event_id AS text), seq FROM outbox "
                    "WHERE event_id = ANY(CAST(:ids AS uuid[]))"
                ),
                {"ids": ids},
            ).all()
        )
    return [found[i] for i in ids]


def test_a_reorder_is_caught_within_and_across_a_counter_restart(engine: sa.Engine) -> None:
    with engine.begin() as conn:
        conn.execute(sa.text(WRITER_COMMIT_ORDER))
    places: dict[str, int] = {}
    first = _commit(engine, ["k", "other", "k"], places)
    old = [first[0], first[2], *_commit(engine, ["k"], places)]
    assert _seqs(engine, old) == [1, 2, 3]
    _deliver_and_purge(engine)
    with engine.connect() as conn:
        assert conn.execute(sa.text("SELECT count(*) FROM outbox_key_seq")).scalar_one() == 0
    new = _commit(engine, ["k", "k"], places)
    assert _seqs(engine, new) == [1, 2]  # the key started again at 1
    assert [places[i] for i in old + new] == [1, 2, 3, 4, 5]

    # In commit order, the restart included: nothing to report.
    stream = [(i, "k") for i in old + new]
    assert commit_order_violations(stream, places) == []

    # Two events of one life swapped.
    swapped = [old[0], old[2], old[1], new[0], new[1]]
    assert len(commit_order_violations([(i, "k") for i in swapped], places)) == 1

    # The last event of the old life after the first of the new one: by sequence
    # number (1 after 3, then 3 after 1) either order looks like a restart.
    across = [old[0], old[1], new[0], old[2], new[1]]
    found = commit_order_violations([(i, "k") for i in across], places)
    assert found == [f"k: {old[2]} (commit #3) after {new[0]} (commit #4)"]


def test_duplicates_other_keys_and_ignored_events_are_not_reorders() -> None:
    places = {"a1": 1, "a2": 2, "a3": 3, "b1": 1, "b2": 2}
    stream = [
        ("a1", "a"),
        ("b1", "b"),
        ("a2", "a"),
        ("a1", "a"),  # a duplicate of an earlier copy
        ("b2", "b"),
        ("a3", "a"),
        ("b1", "b"),
    ]
    assert commit_order_violations(stream, places) == []
    skipped = [("a1", "a"), ("a3", "a"), ("a2", "a")]
    assert len(commit_order_violations(skipped, places)) == 1
    assert commit_order_violations(skipped, places, ignore={"a2"}) == []
