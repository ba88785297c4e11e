"""The log mode's reader of an outbox's slot: what it returns, what it counts and
leaves out, what an acknowledgement does, and one reader at a time."""

from __future__ import annotations

import pytest
import sqlalchemy as sa

from outbox_kafka.relay.log_reader import LogReader, SlotBusy

from ..log_support import NAMES, emit, keys_and_ns, log_outbox, read_log


def test_an_acknowledged_transaction_is_not_sent_again(log_engine: sa.Engine, log_url: str) -> None:
    outbox = log_outbox()
    for n in range(1, 4):
        with log_engine.begin() as conn:
            emit(outbox, conn, "k", n)
    reader = LogReader(log_url, NAMES)
    reader.open()
    try:
        got = []
        while len(got) < 3 and (batch := reader.read(2.0)):
            got += batch
        assert keys_and_ns(got) == [[("k", 1)], [("k", 2)], [("k", 3)]]
        reader.acknowledge(got[0].end_lsn)
    finally:
        reader.close()
    # A new session starts after the acknowledgement, and sends the rest again.
    again, _ = read_log(log_url)
    assert keys_and_ns(again) == [[("k", 2)], [("k", 3)]]


def test_strays_are_counted_and_never_returned(log_engine: sa.Engine, log_url: str) -> None:
    outbox = log_outbox()
    with log_engine.begin() as conn:
        emit(outbox, conn, "k", 1)
        # Another tool's message, in the same transaction; and one sent outside it.
        conn.exec_driver_sql("SELECT pg_logical_emit_message(true, 'other-tool', 'x')")
        conn.exec_driver_sql(
            "SELECT pg_logical_emit_message(false, %(prefix)s, 'y')", {"prefix": NAMES.log_prefix}
        )
        # A frame of this outbox that cannot be read (emitted by a role that may).
        conn.exec_driver_sql("SELECT outbox_emit('\\x0100000001'::bytea)")
        emit(outbox, conn, "k", 2)
    transactions, strays = read_log(log_url)
    assert keys_and_ns(transactions) == [[("k", 1), ("k", 2)]]
    assert (strays.non_transactional, strays.foreign, strays.malformed) == (1, 1, 1)
    assert "event 1 of 1: its id needs 16 bytes" in strays.malformed_reasons[0]


def test_a_second_reader_is_told_the_slot_is_busy_until_the_first_ends(log_url: str) -> None:
    first = LogReader(log_url, NAMES)
    first.open()
    try:
        with pytest.raises(SlotBusy, match=f"replication slot {NAMES.log_slot} is read by"):
            LogReader(log_url, NAMES).open()
    finally:
        first.close()
    # Released a moment after the first session's connection closes.
    second = LogReader(log_url, NAMES)
    for _ in range(50):
        try:
            second.open()
            break
        except SlotBusy:
            import time

            time.sleep(0.1)
    else:
        pytest.fail("the slot stayed busy 5 s after its reader closed")
    second.close()


def test_a_large_transaction_arrives_whole_after_commit_and_an_aborted_one_never(
    log_engine: sa.Engine, log_url: str
) -> None:
    """Larger than logical_decoding_work_mem (64 kB on the test server): protocol 1
    spills it to disk and sends it at commit, never before; an aborted one never."""
    outbox = log_outbox()
    with log_engine.connect() as conn:
        size = conn.exec_driver_sql("SHOW logical_decoding_work_mem").scalar_one()
        assert size == "64kB"
    with log_engine.connect() as aborted:
        aborted.begin()
        for n in range(1, 401):
            emit(outbox, aborted, "big", -n)
        big = log_engine.connect()
        try:
            with big.begin():
                for n in range(1, 401):
                    emit(outbox, big, "big", n)
            # Read while the aborted one is still open: the committed one only.
            transactions, _ = read_log(log_url)
            assert keys_and_ns(transactions) == [[("big", n) for n in range(1, 401)]]
        finally:
            big.close()
        aborted.rollback()
    transactions, _ = read_log(log_url)
    assert [len(t.events) for t in transactions] == [400]
