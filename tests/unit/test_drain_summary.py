"""What ``relay --drain`` prints of what it left: held events named with their reasons."""

from __future__ import annotations

from outbox_kafka.relay.batch import CycleReport, DrainResult, Remaining

REASON = (
    "UNKNOWN_TOPIC: topic 'orders' does not exist and topic creation is off "
    "(create it, or run the relay with --create-topics <partitions>; its events wait)"
)


def _left(**counts: int) -> Remaining:
    values = {"leased": 0, "parked": 0, "retrying": 0, "delayed": 0, "due": 0, "unreachable": 0}
    values.update(counts)
    pending = sum(values.values())
    return Remaining(pending=pending, next_due_seconds=2.0, **values)


def test_held_events_are_named_with_their_reason_not_as_delayed() -> None:
    left = Remaining(
        pending=9,
        leased=0,
        parked=0,
        retrying=0,
        delayed=9,
        due=0,
        unreachable=0,
        next_due_seconds=2.0,
        held=9,
        held_reason_count=1,
        held_reasons=(REASON,),
    )
    summary = DrainResult(CycleReport(retried=3), left).summary()
    assert summary == (
        "drained: 0 delivered, 0 discarded, 3 retried or held, 0 leases lost; "
        f"left pending: 9 (9 held: {REASON}); the next key comes due in 2.0 s"
    )
    assert not DrainResult(CycleReport(), left).complete


def test_held_is_a_part_of_delayed_and_a_few_reasons_are_named() -> None:
    reasons = [f"R{i}" for i in range(5)]
    left = Remaining(
        pending=12,
        leased=0,
        parked=2,
        retrying=0,
        delayed=10,
        due=0,
        unreachable=0,
        next_due_seconds=1.0,
        held=7,
        held_reason_count=5,
        held_reasons=tuple(reasons[:3]),
    )
    summary = DrainResult(CycleReport(), left).summary()
    assert (
        "left pending: 12 (7 held: R0 | R1 | R2 | and 2 other reasons, "
        "2 on parked keys (outbox-kafka requeue or unpark), 3 delayed (available_at))"
    ) in summary


def test_a_store_that_does_not_tell_held_events_apart_still_counts_each_once() -> None:
    """Built from a dict of counts, as a store may, held defaults to none."""
    left = _left(delayed=4)
    assert (left.held, left.held_reasons, left.held_reason_count) == (0, (), 0)
    assert (
        "left pending: 4 (4 delayed (available_at))" in DrainResult(CycleReport(), left).summary()
    )
