"""The read-back's pure parts: murmur2 and the key's partition, the decisions about a
start offset, what a consumer's events make of a read (on a scripted consumer), and
which events in doubt the messages read back are."""

from __future__ import annotations

import concurrent.futures
import logging
import random
import time
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    ClusterMetadata,
    PartitionMetadata,
    TopicMetadata,
)

from outbox_kafka.errors import ConfigurationError
from outbox_kafka.relay.ports import Found
from outbox_kafka.relay.recover import (
    Candidate,
    PartitionCache,
    PartitionReader,
    ReadBackError,
    key_partition,
    matches,
    murmur2,
    reader_config,
    start_problem,
)
from tests.relay_support import murmur2 as reference_murmur2

# --------------------------------------------------------------------------- murmur2


def test_murmur2_matches_kafka_reference_vectors() -> None:
    # org.apache.kafka.common.utils.UtilsTest#testMurmur2
    vectors = {
        b"21": -973932308,
        b"foobar": -790332482,
        b"a-little-bit-long-string": -985981536,
        b"a-little-bit-longer-string": -1486304829,
        b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8": -58897971,
        b"abc": 479470107,
    }
    for data, expected in vectors.items():
        assert murmur2(data) == expected, data


def test_murmur2_agrees_with_the_line_by_line_java_port_on_every_length() -> None:
    rng = random.Random(7)
    for length in range(0, 70):
        for _ in range(20):
            data = bytes(rng.randrange(256) for _ in range(length))
            assert murmur2(data) == reference_murmur2(data), data


def test_key_partition() -> None:
    assert key_partition(b"21", 6) == (-973932308 & 0x7FFFFFFF) % 6
    assert key_partition(b"foobar", 7) == (-790332482 & 0x7FFFFFFF) % 7
    # An empty key is a key: hashed, not spread at random.
    assert key_partition(b"", 7) == (murmur2(b"") & 0x7FFFFFFF) % 7
    assert all(key_partition(b"k", 1) == 0 for _ in range(3))
    with pytest.raises(ValueError):
        key_partition(b"k", 0)


def test_partition_cache_answers_as_key_partition_and_stays_bounded() -> None:
    cache = PartitionCache(max_entries=10)
    keys = [f"key-{i}".encode() for i in range(25)]
    for _ in range(2):
        for key in keys:
            for partitions in (3, 7):
                assert cache.partition(key, partitions) == key_partition(key, partitions)
                assert len(cache) <= 10
    assert len(cache) > 0
    with pytest.raises(ValueError):
        PartitionCache(max_entries=0)


# --------------------------------------------------------------------------- start offsets


def test_start_problem() -> None:
    assert start_problem(0, None) is None
    assert start_problem(5, 5) is None
    assert start_problem(9, 5) is None
    below = start_problem(4, 5)
    assert below is not None and "below the log start 5" in below
    negative = start_problem(-1, None)
    assert negative is not None and "not an offset" in negative


def test_reader_config_adds_what_the_read_back_needs() -> None:
    config = reader_config(
        {"bootstrap.servers": "b:9092", "isolation.level": "read_committed", "group.id": "g"}
    )
    assert config["bootstrap.servers"] == "b:9092"
    assert config["isolation.level"] == "read_uncommitted"
    assert config["enable.auto.commit"] == "false"
    assert config["enable.partition.eof"] == "true"
    assert config["auto.offset.reset"] == "error"
    assert config["group.id"] != "g"
    assert config["group.id"] != reader_config({})["group.id"]


# --------------------------------------------------------------------------- a scripted consumer


def _metadata(topics: dict[str, int]) -> ClusterMetadata:
    cluster = ClusterMetadata()
    for name, count in topics.items():
        topic = TopicMetadata()
        topic.topic = name
        for p in range(count):
            partition = PartitionMetadata()
            partition.id = p
            topic.partitions[p] = partition
        cluster.topics[name] = topic
    return cluster


def _eof(topic: str, partition: int, offset: int) -> Message:
    return Message(
        topic=topic,
        partition=partition,
        offset=offset,
        error=KafkaError(KafkaError._PARTITION_EOF),
    )


def _record(topic: str, partition: int, offset: int, key: bytes | None) -> Message:
    return Message(
        topic=topic, partition=partition, offset=offset, key=key, value=b"v", headers=[("h", None)]
    )


class ScriptedConsumer:
    """Answers consume() with the batches it is given, then with nothing."""

    def __init__(self, topics: dict[str, int], batches: list[list[Message]]) -> None:
        self.metadata = _metadata(topics)
        self.batches = list(batches)
        self.assigned: list[TopicPartition] = []
        self.unassigned = 0
        self.closed = False
        self.raise_on_consume: Exception | None = None

    def list_topics(self, topic: str | None = None, timeout: float = -1) -> ClusterMetadata:
        return self.metadata

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = partitions

    def unassign(self) -> None:
        self.unassigned += 1

    def consume(self, num_messages: int = 1, timeout: float = -1) -> list[Message]:
        if self.raise_on_consume is not None:
            raise self.raise_on_consume
        if self.batches:
            return self.batches.pop(0)
        time.sleep(min(timeout, 0.01))
        return []

    def position(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        return [TopicPartition(tp.topic, tp.partition, 3) for tp in partitions]

    def get_watermark_offsets(
        self, partition: TopicPartition, timeout: float = -1, cached: bool = False
    ) -> tuple[int, int]:
        if partition.partition >= len(self.metadata.topics[partition.topic].partitions):
            raise KafkaException(KafkaError(KafkaError._UNKNOWN_PARTITION))
        return 0, 10

    def close(self) -> None:
        self.closed = True


def _reader(consumer: ScriptedConsumer) -> PartitionReader:
    return PartitionReader({}, make_consumer=lambda config: consumer)  # type: ignore[arg-type,return-value]


def test_read_keeps_the_keys_asked_and_completes_at_the_end_of_each_partition() -> None:
    consumer = ScriptedConsumer(
        {"t": 2},
        [
            [_record("t", 0, 4, b"a"), _record("t", 0, 5, b"b"), _record("t", 1, 0, None)],
            [_record("t", 0, 6, b"a"), _eof("t", 0, 7), _eof("t", 1, 1)],
        ],
    )
    back = _reader(consumer).read({("t", 0): 4, ("t", 1): 0}, {b"a"}, time.monotonic() + 5)
    assert [(f.offset, f.key) for f in back.found] == [(4, b"a"), (6, b"a")]
    assert back.found[0].headers == [("h", b"")]
    assert back.read == 4
    assert back.complete == {("t", 0), ("t", 1)}
    assert back.ends == {("t", 0): 7, ("t", 1): 1}
    assert back.unproven == {}
    assert [(tp.topic, tp.partition, tp.offset) for tp in consumer.assigned] == [
        ("t", 0, 4),
        ("t", 1, 0),
    ]
    assert consumer.unassigned == 1


def test_an_offset_out_of_range_leaves_its_partition_unproven() -> None:
    # A start below the log start (messages deleted): with auto.offset.reset=error
    # librdkafka reports _AUTO_OFFSET_RESET for the partition instead of jumping.
    reset = Message(
        topic="t", partition=0, offset=2, error=KafkaError(KafkaError._AUTO_OFFSET_RESET)
    )
    consumer = ScriptedConsumer({"t": 2}, [[reset, _eof("t", 1, 9)]])
    back = _reader(consumer).read({("t", 0): 2, ("t", 1): 0}, {b"a"}, time.monotonic() + 5)
    assert back.complete == {("t", 1)}
    assert set(back.unproven) == {("t", 0)}
    assert "out of range" in back.unproven[("t", 0)]


def test_an_end_below_the_start_does_not_complete_the_partition() -> None:
    consumer = ScriptedConsumer({"t": 1}, [[_eof("t", 0, 3)]])
    started = time.monotonic()
    back = _reader(consumer).read({("t", 0): 5}, {b"a"}, started + 0.3)
    assert time.monotonic() - started < 2
    assert back.complete == set()
    assert "deadline reached at offset 3" in back.unproven[("t", 0)]


def test_missing_topics_and_partitions_and_bad_starts_are_unproven_without_reading() -> None:
    consumer = ScriptedConsumer({"t": 2}, [[_eof("t", 0, 0)]])
    back = _reader(consumer).read(
        {("t", 0): 0, ("t", 5): 0, ("gone", 0): 0, ("t", 1): -1}, {b"a"}, time.monotonic() + 5
    )
    assert back.complete == {("t", 0)}
    assert set(back.unproven) == {("t", 5), ("gone", 0), ("t", 1)}
    assert "does not exist" in back.unproven[("t", 5)]
    assert "not in the metadata" in back.unproven[("gone", 0)]
    assert "not an offset" in back.unproven[("t", 1)]
    assert [(tp.topic, tp.partition) for tp in consumer.assigned] == [("t", 0)]


def test_a_failing_consumer_leaves_every_partition_unproven_and_is_replaced() -> None:
    consumer = ScriptedConsumer({"t": 2}, [])
    consumer.raise_on_consume = KafkaException(KafkaError(KafkaError._TRANSPORT))
    made: list[ScriptedConsumer] = []

    def make(config: dict[str, Any]) -> ScriptedConsumer:
        made.append(consumer)
        return consumer

    reader = PartitionReader({}, make_consumer=make)  # type: ignore[arg-type]
    back = reader.read({("t", 0): 0, ("t", 1): 0}, {b"a"}, time.monotonic() + 5)
    assert back.complete == set()
    assert set(back.unproven) == {("t", 0), ("t", 1)}
    assert all("consumer failed" in why for why in back.unproven.values())
    assert consumer.closed
    reader.read({("t", 0): 0}, {b"a"}, time.monotonic() + 0.1)
    assert len(made) == 2


def test_end_offsets_translate_kafka_errors() -> None:
    reader = _reader(ScriptedConsumer({"t": 2}, []))
    assert reader.end_offsets("t", [0, 1], 5) == {0: 10, 1: 10}
    with pytest.raises(ReadBackError, match="partition 3"):
        reader.end_offsets("t", [0, 3], 5)


def test_settings_librdkafka_refuses_are_a_configuration_error() -> None:
    reader = PartitionReader({"no.such.setting": "1"})
    with pytest.raises(ConfigurationError):
        reader.read({("t", 0): 0}, {b"a"}, time.monotonic() + 1)


class ScriptedAdmin:
    """Answers ``describe_configs`` with the cleanup policy of each topic it knows
    (a missing entry when it has none); counts the calls."""

    def __init__(
        self,
        policies: dict[str, str | None],
        error: Exception | None = None,
        *,
        silent: bool = False,
    ) -> None:
        self.policies = policies
        self.error = error
        #: Never answers (a broker that does not reply).
        self.silent = silent
        self.asked: list[str] = []

    def describe_configs(self, resources: list[Any], request_timeout: float) -> dict[Any, Any]:
        name = resources[0].name
        self.asked.append(name)
        future: concurrent.futures.Future[dict[str, Any]] = concurrent.futures.Future()
        if self.silent:
            return {resources[0]: future}
        if self.error is not None:
            future.set_exception(self.error)
            return {resources[0]: future}
        policy = self.policies.get(name)
        entries = {} if policy is None else {"cleanup.policy": SimpleNamespace(value=policy)}
        future.set_result(entries)
        return {resources[0]: future}


def test_compacted_reads_the_cleanup_policy_and_keeps_the_answer() -> None:
    admin = ScriptedAdmin(
        {"c": "compact", "d": "delete", "both": "compact,delete", "spaced": "delete, compact"}
    )
    reader = PartitionReader({}, make_admin=lambda config: admin)
    assert reader.compacted("c", 1) is True
    assert reader.compacted("both", 1) is True
    assert reader.compacted("spaced", 1) is True
    assert reader.compacted("d", 1) is False
    # A broker that says nothing: not known.
    assert reader.compacted("silent", 1) is None
    assert reader.compacted("c", 1) is True
    assert admin.asked == ["c", "both", "spaced", "d", "silent"]  # asked once each


def test_compacted_is_not_known_when_the_broker_refuses_to_say(
    caplog: pytest.LogCaptureFixture,
) -> None:
    refused = KafkaException(KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED))
    reader = PartitionReader({}, make_admin=lambda config: ScriptedAdmin({}, error=refused))
    with caplog.at_level(logging.WARNING, logger="outbox_kafka.relay"):
        assert reader.compacted("t", 1) is None
        assert reader.compacted("t", 1) is None
    # Said once: the operator learns that compaction cannot be noticed on "t".
    said = [r for r in caplog.records if "does not tell whether topic 't'" in r.getMessage()]
    assert len(said) == 1


def test_no_answer_about_the_policy_is_a_read_back_error_and_is_not_kept() -> None:
    # A broker slow or away: nothing is known, so the read-back cannot go on as if
    # the topic were not compacted; the next read-back asks again.
    lost = KafkaException(KafkaError(KafkaError._TRANSPORT))
    admin = ScriptedAdmin({"t": "compact"}, error=lost)
    reader = PartitionReader({}, make_admin=lambda config: admin)
    with pytest.raises(ReadBackError, match="cleanup policy of topic 't'"):
        reader.compacted("t", 1)
    admin.error = None
    assert reader.compacted("t", 1) is True
    assert admin.asked == ["t", "t"]
    silent = PartitionReader({}, make_admin=lambda config: ScriptedAdmin({}, silent=True))
    with pytest.raises(ReadBackError, match="no answer"):
        silent.compacted("t", 0.1)


# --------------------------------------------------------------------------- matches

ID = "0190a1b2-c3d4-7e5f-8a9b-0c1d2e3f4a5b"
OTHER_ID = "0190a1b2-c3d4-7e5f-8a9b-ffffffffffff"


def _structured(event_id: str, data: str) -> bytes:
    return f'{{"specversion":"1.0","id":"{event_id}","data":{data}}}'.encode()


def _found(
    offset: int,
    value: bytes,
    headers: list[tuple[str, bytes]] | None = None,
    *,
    key: bytes = b"k",
    topic: str = "t",
) -> Found:
    return Found(topic, 0, offset, key, value, headers or [])


def test_a_structured_event_is_found_by_its_value() -> None:
    value = _structured(ID, '{"n":1}')
    candidate = Candidate(ID, b"k", "t", value, [("content-type", b"application/cloudevents")])
    message = _found(3, value, [("content-type", b"application/cloudevents")])
    assert matches([message], [candidate]) == {ID: message}


def test_a_binary_event_is_found_by_its_ce_id_header() -> None:
    value = b'{"n":1}'
    candidate = Candidate(ID, b"k", "t", value, [("ce_id", ID.encode()), ("ce_type", b"x")])
    message = _found(3, value, [("ce_id", ID.encode()), ("ce_type", b"x"), ("traceparent", b"t")])
    assert matches([message], [candidate]) == {ID: message}
    # The same data under another id is another event's.
    other = _found(2, value, [("ce_id", OTHER_ID.encode()), ("ce_type", b"x")])
    assert matches([other], [candidate]) == {}


def test_an_outbox_with_an_id_header_is_found_by_that_header() -> None:
    value = _structured(ID, '{"n":1}')
    candidate = Candidate(ID, b"k", "t", value, [("event-id", ID.encode())])
    assert matches([_found(1, value, [("event-id", ID.encode())])], [candidate])
    # The header the outbox puts the id in is missing: not proven to be this event.
    assert matches([_found(1, value, [("other", ID.encode())])], [candidate]) == {}


def test_two_outboxes_with_one_id_and_different_data_are_not_confused() -> None:
    mine = Candidate(ID, b"k", "t", b'{"n":1}', [("ce_id", ID.encode())])
    theirs = _found(5, b'{"n":2}', [("ce_id", ID.encode())])
    assert matches([theirs], [mine]) == {}
    ours = _found(6, b'{"n":1}', [("ce_id", ID.encode())])
    assert matches([theirs, ours], [mine]) == {ID: ours}


def test_the_right_id_with_a_changed_value_is_not_a_match() -> None:
    candidate = Candidate(ID, b"k", "t", _structured(ID, '{"n":1}'), [])
    assert matches([_found(1, _structured(ID, '{"n":9}'))], [candidate]) == {}


def test_wrong_key_or_wrong_topic_is_not_a_match() -> None:
    value = _structured(ID, '{"n":1}')
    candidate = Candidate(ID, b"k", "t", value, [])
    assert matches([_found(1, value, key=b"j")], [candidate]) == {}
    assert matches([_found(1, value, topic="u")], [candidate]) == {}


def test_a_candidate_takes_its_first_message_and_a_message_one_candidate() -> None:
    value = b'{"same":true}'
    first = Candidate(ID, b"k", "t", value, [("ce_id", ID.encode())])
    second = Candidate(OTHER_ID, b"k", "t", value, [("ce_id", OTHER_ID.encode())])
    copy_a = _found(7, value, [("ce_id", ID.encode())])
    copy_b = _found(4, value, [("ce_id", ID.encode())])
    found = matches([copy_a, copy_b], [first, second])
    assert found == {ID: copy_b}
    # Two events with the same id, value and key cannot be told apart: each message
    # is still only one candidate's.
    twin = Candidate(ID, b"k", "t", _structured(ID, "1"), [])
    assert matches([_found(1, twin.value)], [twin]) == {ID: _found(1, twin.value)}
    with pytest.raises(ValueError):
        matches([], [twin, twin])


def test_a_candidate_that_carries_its_id_nowhere_matches_nothing() -> None:
    candidate = Candidate(ID, b"k", "t", b'{"n":1}', [])
    assert matches([_found(1, b'{"n":1}')], [candidate]) == {}
