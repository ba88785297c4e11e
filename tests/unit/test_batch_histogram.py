"""BatchHistogram reads on /metrics as prometheus_client's own Histogram would."""

from __future__ import annotations

import threading

import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from outbox_kafka.relay.batch_histogram import BatchHistogram

BUCKETS = (0.005, 0.01, 0.25, 1.0, 2.5, 60.0)
#: Values on the bounds, between them, below the first, past the last.
VALUES = [0.0, 0.005, 0.0051, 0.01, 0.3, 1.0, 1.0000001, 2.5, 59.9, 60.0, 61.0, 1e9, -1.0]


def _exposition(registry: CollectorRegistry) -> list[str]:
    """The text format's lines, ``_created`` values left out (they differ by clock)."""
    return [
        line.rsplit(" ", 1)[0] if "_created" in line else line
        for line in generate_latest(registry).decode().splitlines()
    ]


def test_a_batch_reads_as_the_same_values_observed_one_by_one() -> None:
    ours, theirs = CollectorRegistry(), CollectorRegistry()
    batched = BatchHistogram("outbox_test_seconds", "A test histogram.", BUCKETS, ours)
    single = Histogram("outbox_test_seconds", "A test histogram.", buckets=BUCKETS, registry=theirs)
    batched.observe_many(VALUES[:5])
    batched.observe_many([])
    batched.observe_many(VALUES[5:])
    batched.observe(0.02)
    for value in [*VALUES, 0.02]:
        single.observe(value)
    assert _exposition(ours) == _exposition(theirs)
    assert ours.get_sample_value("outbox_test_seconds_count") == len(VALUES) + 1
    assert ours.get_sample_value("outbox_test_seconds_bucket", {"le": "0.005"}) == 3


def test_batches_from_several_threads_are_all_counted() -> None:
    registry = CollectorRegistry()
    histogram = BatchHistogram("outbox_test_seconds", "A test histogram.", BUCKETS, registry)

    def observe() -> None:
        for _ in range(200):
            histogram.observe_many([0.001, 0.5, 100.0])

    threads = [threading.Thread(target=observe) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert registry.get_sample_value("outbox_test_seconds_count") == 4 * 200 * 3
    assert registry.get_sample_value("outbox_test_seconds_bucket", {"le": "1.0"}) == 4 * 200 * 2
    assert registry.get_sample_value("outbox_test_seconds_sum") == pytest.approx(4 * 200 * 100.501)


@pytest.mark.parametrize("buckets", [(), (1.0, 1.0), (1.0, float("inf")), (float("nan"),)])
def test_bad_buckets_are_refused(buckets: tuple[float, ...]) -> None:
    with pytest.raises(ValueError, match="buckets"):
        BatchHistogram("outbox_test_seconds", "A test histogram.", buckets, None)
