"""The tests' topic reader goes back to a record batch that became readable after a
later one of its partition, as the test broker can let happen while two producers
append at once, and reads every record once."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import TopicPartition

from tests import relay_support
from tests.relay_support import TopicReader


class _Message:
    def __init__(self, partition: int, offset: int) -> None:
        self._partition, self._offset = partition, offset

    def error(self) -> None:
        return None

    def partition(self) -> int:
        return self._partition

    def offset(self) -> int:
        return self._offset

    def value(self) -> bytes:
        return b'{"id": "%d-%d"}' % (self._partition, self._offset)

    def key(self) -> bytes:
        return b"k"

    def headers(self) -> list[tuple[str, bytes]]:
        return []


class _Broker:
    """One partition whose offsets 10-19 become readable only after 20-29 were read."""

    def __init__(self) -> None:
        self.visible = [*range(10), *range(20, 30)]
        self.position = 0
        self.fetches = 0
        self.seeks: list[int] = []

    def fetch(self) -> list[_Message]:
        self.fetches += 1
        if self.fetches == 3:
            self.visible = list(range(30))  # the late batch becomes readable
        ahead = [o for o in self.visible if o >= self.position]
        if ahead:
            self.position = max(ahead) + 1
        return [_Message(0, o) for o in ahead]


class _Consumer:
    broker: _Broker

    def __init__(self, conf: dict[str, Any]) -> None:
        pass

    def list_topics(self, topic: str, timeout: float) -> Any:
        return SimpleNamespace(topics={topic: SimpleNamespace(error=None, partitions={0: None})})

    def assign(self, partitions: list[TopicPartition]) -> None:
        pass

    def consume(self, num_messages: int, timeout: float) -> list[_Message]:
        return self.broker.fetch()

    def seek(self, partition: TopicPartition) -> None:
        self.broker.seeks.append(partition.offset)
        self.broker.position = partition.offset

    def close(self) -> None:
        pass


def test_a_batch_readable_after_a_later_one_is_read_once(monkeypatch: pytest.MonkeyPatch) -> None:
    broker = _Broker()
    monkeypatch.setattr(_Consumer, "broker", broker, raising=False)
    monkeypatch.setattr(relay_support, "Consumer", _Consumer)
    reader = TopicReader("broker:9092", "t")
    reader.poll(0.3)
    assert sorted(r.offset for r in reader.records) == list(range(30))
    assert len(reader.records) == 30
    assert broker.seeks and broker.seeks[0] == 10
    assert reader.reread > 0  # 20-29 came again after going back, and were skipped
