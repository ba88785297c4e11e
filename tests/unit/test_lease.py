"""The lease rule (outbox_kafka/relay/lease.py): what a claim's lease lets the relay do."""

from __future__ import annotations

import time

import pytest

from outbox_kafka import ConfigurationError
from outbox_kafka.relay.lease import (
    Lease,
    check_delivery_timeout,
    in_flight_hold,
    metadata_wait,
)


def test_the_delivery_timeout_may_take_up_to_80_percent_of_the_lease() -> None:
    check_delivery_timeout(24_000, 30.0)
    with pytest.raises(ConfigurationError, match=r"24001 ms\) must be at most 80% of the lease"):
        check_delivery_timeout(24_001, 30.0)


def test_the_refusal_says_what_to_change() -> None:
    with pytest.raises(ConfigurationError, match=r"delivery\.timeout\.ms or raise --lease-seconds"):
        check_delivery_timeout(10_000, 10.0)


def test_a_key_with_an_event_still_in_the_producer_waits_a_whole_lease() -> None:
    assert in_flight_hold(30.0) == 30.0


def test_metadata_waits_a_quarter_of_the_lease_and_never_more_than_five_seconds() -> None:
    assert metadata_wait(8.0) == 2.0
    assert metadata_wait(30.0) == 5.0


def test_a_lease_ends_its_length_after_the_claim_was_asked_for() -> None:
    assert Lease(30.0, 20.0).ends(100.0) == 130.0


def test_what_is_left_of_a_lease_counts_down_on_the_monotonic_clock() -> None:
    ends = time.monotonic() + 10.0
    assert 9.0 < Lease.left(ends) <= 10.0
    assert Lease.left(time.monotonic() - 1.0) < 0


def test_a_send_starts_only_with_one_delivery_timeout_of_the_lease_left() -> None:
    lease = Lease(30.0, 20.0)
    assert lease.room_to_send(20.0)
    assert not lease.room_to_send(19.99)


def test_a_claim_read_ahead_is_usable_only_while_a_send_still_fits_in_its_lease() -> None:
    lease = Lease(30.0, 20.0)
    now = time.monotonic()
    assert lease.still_usable(now - 5.0)  # 25 s left
    assert not lease.still_usable(now - 11.0)  # 19 s left: too little for a send
