"""Reading back what reached Kafka (relay/recover.py) on the real broker: the partition
a key goes to, reads to the end of partitions from given offsets, the partitions that
cannot be read, end offsets, and the events in doubt found among what was read."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence

import pytest
from confluent_kafka import Producer

from outbox_kafka.relay.recover import (
    Candidate,
    PartitionReader,
    ReadBackError,
    key_partition,
    matches,
)


class Sent:
    """A message produced and acknowledged: where it landed."""

    def __init__(self, key: bytes, value: bytes, partition: int, offset: int) -> None:
        self.key, self.value, self.partition, self.offset = key, value, partition, offset


def produce(
    bootstrap: str,
    topic: str,
    messages: Sequence[tuple[bytes, bytes, list[tuple[str, bytes]]]],
) -> list[Sent]:
    """Send ``messages`` (key, value, headers) with the relay's partitioner; every one
    acknowledged, in order."""
    producer = Producer(
        {
            "bootstrap.servers": bootstrap,
            "partitioner": "murmur2_random",
            "enable.idempotence": "true",
            "linger.ms": "5",
        }
    )
    sent: list[Sent | None] = [None] * len(messages)
    errors: list[str] = []

    def report(i: int, key: bytes, value: bytes) -> Callable[..., None]:
        def on_delivery(err: object, msg: object) -> None:
            if err is not None:
                errors.append(str(err))
                return
            sent[i] = Sent(key, value, msg.partition(), msg.offset())  # type: ignore[attr-defined]

        return on_delivery

    for i, (key, value, headers) in enumerate(messages):
        producer.produce(
            topic,
            value,
            key,
            headers=list[tuple[str, str | bytes | None]](headers),
            on_delivery=report(i, key, value),
        )
        producer.poll(0)
    assert producer.flush(30) == 0
    assert errors == []
    assert all(s is not None for s in sent)
    return [s for s in sent if s is not None]


@pytest.fixture
def reader(kafka_bootstrap: str) -> Iterator[PartitionReader]:
    reader = PartitionReader({"bootstrap.servers": kafka_bootstrap})
    yield reader
    reader.close()


def test_key_partition_is_where_librdkafka_murmur2_random_sends_a_key(
    kafka_bootstrap: str, new_topic: Callable[..., str]
) -> None:
    topic = new_topic(7)
    keys = [b""]
    keys += [f"order-{i}".encode() for i in range(120)]
    keys += [f"clé-{i}-ünïcødé-键".encode() for i in range(40)]
    keys += [(f"long-{i}-" * (i + 20)).encode() for i in range(30)]
    keys += [bytes([i, 0, 255 - i]) for i in range(9)]
    assert len(set(keys)) == 200
    sent = produce(kafka_bootstrap, topic, [(k, b"v", []) for k in keys])
    wrong = [(s.key, s.partition) for s in sent if s.partition != key_partition(s.key, 7)]
    assert wrong == []
    assert len({s.partition for s in sent}) == 7


def _spread(bootstrap: str, topic: str, count: int) -> list[Sent]:
    """``count`` messages over 6 keys, on the key's partition of 3."""
    keys = [f"key-{i}".encode() for i in range(6)]
    messages = [
        (keys[i % 6], f'{{"i":{i}}}'.encode(), [("ce_id", f"id-{i}".encode())])
        for i in range(count)
    ]
    sent = produce(bootstrap, topic, messages)
    assert {key_partition(k, 3) for k in keys} == {0, 1, 2}, "every partition has a key"
    return sent


def test_read_from_the_start_finds_exactly_the_keys_asked_with_their_offsets(
    kafka_bootstrap: str, new_topic: Callable[..., str], reader: PartitionReader
) -> None:
    topic = new_topic(3)
    sent = _spread(kafka_bootstrap, topic, 600)
    asked = {b"key-1", b"key-4"}
    starts = {(topic, p): 0 for p in range(3)}
    back = reader.read(starts, asked, time.monotonic() + 20)
    assert back.unproven == {}
    assert back.complete == set(starts)
    assert back.read == 600
    expected = sorted((s.partition, s.offset, s.key, s.value) for s in sent if s.key in asked)
    got = sorted((f.partition, f.offset, f.key, f.value) for f in back.found)
    assert got == expected
    assert all(f.topic == topic for f in back.found)
    assert all(f.headers[0][0] == "ce_id" for f in back.found)
    # The read reaches each partition's true end.
    per_partition = Counter(s.partition for s in sent)
    assert back.ends == {(topic, p): per_partition[p] for p in range(3)}


def test_read_from_a_middle_offset_finds_only_the_later_messages(
    kafka_bootstrap: str, new_topic: Callable[..., str], reader: PartitionReader
) -> None:
    topic = new_topic(3)
    sent = _spread(kafka_bootstrap, topic, 300)
    middle = {p: Counter(s.partition for s in sent)[p] // 2 for p in range(3)}
    asked = {f"key-{i}".encode() for i in range(6)}
    starts = {(topic, p): middle[p] for p in range(3)}
    back = reader.read(starts, asked, time.monotonic() + 20)
    assert back.complete == set(starts)
    expected = sorted((s.partition, s.offset) for s in sent if s.offset >= middle[s.partition])
    assert sorted((f.partition, f.offset) for f in back.found) == expected
    assert back.read == len(expected)
    # A second read on the same reader: the start at the end is complete at once.
    ends = {(topic, p): Counter(s.partition for s in sent)[p] for p in range(3)}
    again = reader.read(ends, asked, time.monotonic() + 20)
    assert again.complete == set(ends)
    assert (again.found, again.read) == ([], 0)


def test_a_start_past_the_end_is_unproven_by_the_deadline(
    kafka_bootstrap: str, new_topic: Callable[..., str], reader: PartitionReader
) -> None:
    topic = new_topic(3)
    sent = _spread(kafka_bootstrap, topic, 30)
    starts = {(topic, 0): 1_000_000, (topic, 1): 0}
    started = time.monotonic()
    back = reader.read(starts, {b"key-0"}, started + 1.5)
    assert time.monotonic() - started < 1.5 + 2
    assert set(back.unproven) == {(topic, 0)}
    assert back.complete == {(topic, 1)}
    assert back.read == sum(1 for s in sent if s.partition == 1)


def test_a_partition_or_topic_that_does_not_exist_is_unproven(
    kafka_bootstrap: str, new_topic: Callable[..., str], reader: PartitionReader
) -> None:
    topic = new_topic(3)
    _spread(kafka_bootstrap, topic, 30)
    missing = f"{topic}-missing"
    starts = {(topic, 0): 0, (topic, 3): 0, (missing, 0): 0}
    started = time.monotonic()
    back = reader.read(starts, {b"key-0"}, started + 10)
    assert time.monotonic() - started < 10
    assert back.complete == {(topic, 0)}
    assert set(back.unproven) == {(topic, 3), (missing, 0)}
    assert "does not exist" in back.unproven[(topic, 3)]
    with pytest.raises(ReadBackError):
        reader.end_offsets(topic, [3], 5)


def test_end_offsets_never_pass_the_true_end(
    kafka_bootstrap: str, new_topic: Callable[..., str], reader: PartitionReader
) -> None:
    topic = new_topic(3)
    empty = reader.end_offsets(topic, [0, 1, 2], 10)
    assert empty == {0: 0, 1: 0, 2: 0}
    sent = _spread(kafka_bootstrap, topic, 300)
    true_end = Counter(s.partition for s in sent)
    ends = reader.end_offsets(topic, [0, 1, 2], 10)
    # A broker's listed end may lag (the test broker's can name the last record
    # batch's base offset + 1), never lead; the read to the end reaches the true end.
    assert set(ends) == {0, 1, 2}
    assert all(0 < ends[p] <= true_end[p] for p in range(3)), (ends, true_end)
    back = reader.read({(topic, p): 0 for p in range(3)}, set(), time.monotonic() + 20)
    assert back.ends == {(topic, p): true_end[p] for p in range(3)}


def test_events_in_doubt_are_found_among_what_was_read(
    kafka_bootstrap: str, new_topic: Callable[..., str], reader: PartitionReader
) -> None:
    topic = new_topic(3)
    structured = b'{"specversion":"1.0","id":"ev-1","data":{"n":1}}'
    binary = b'{"n":2}'
    landed = [
        (b"k", structured, [("content-type", b"application/cloudevents+json")]),
        (b"k", binary, [("ce_id", b"ev-2"), ("ce_type", b"t")]),
        # Another outbox's event on the same topic and key, with the same id as ev-2.
        (b"k", b'{"n":99}', [("ce_id", b"ev-2"), ("ce_type", b"t")]),
        (b"other", b'{"n":3}', [("ce_id", b"ev-3")]),
    ]
    sent = produce(kafka_bootstrap, topic, landed)
    candidates = [
        Candidate("ev-1", b"k", topic, structured, [("content-type", b"x")]),
        Candidate("ev-2", b"k", topic, binary, [("ce_id", b"ev-2"), ("ce_type", b"t")]),
        Candidate("ev-4", b"k", topic, b'{"n":4}', [("ce_id", b"ev-4")]),
    ]
    partition = key_partition(b"k", 3)
    back = reader.read({(topic, partition): 0}, {c.key for c in candidates}, time.monotonic() + 20)
    assert back.complete == {(topic, partition)}
    on_kafka = matches(back.found, candidates)
    assert sorted(on_kafka) == ["ev-1", "ev-2"]
    assert on_kafka["ev-2"].offset == sent[1].offset
    assert on_kafka["ev-1"].offset == sent[0].offset
