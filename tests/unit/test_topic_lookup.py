"""TopicLookup, which both relays ask whether a topic is there to send to: what it
asks the cluster, how long it trusts an answer, and what it says when it cannot tell."""

from __future__ import annotations

import concurrent.futures
from types import SimpleNamespace
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from outbox_kafka.relay.batch import Verdict
from outbox_kafka.relay.topic_admin import (
    METADATA_RETRY_SECONDS,
    MISSING_TOPIC_SECONDS,
    TopicLookup,
)


class Cluster:
    """Metadata of ``topics`` (by name: an error or None), as a broker gives it: the list
    of every topic leaves out those listed with an error (a principal sees only what it
    may describe); asked by name, a topic comes with its error, a missing one with
    UNKNOWN_TOPIC_OR_PART. Counts the requests and fails them while ``down``."""

    def __init__(self, **topics: KafkaError | None) -> None:
        self.topics = dict(topics)
        self.down = False
        self.asked: list[str | None] = []

    def list_topics(self, topic: str | None, timeout: float) -> Any:
        self.asked.append(topic)
        if self.down:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "Failed to get metadata"))
        if topic is None:
            listed = {name: None for name, error in self.topics.items() if error is None}
        else:
            missing = KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART)
            listed = {topic: self.topics.get(topic, missing)}
        return SimpleNamespace(
            topics={
                name: SimpleNamespace(error=error, partitions={0: None, 1: None})
                for name, error in listed.items()
            }
        )


class Admin:
    """An admin client whose topic creations end as ``outcome`` says."""

    def __init__(self, outcome: BaseException | None = None) -> None:
        self.outcome = outcome
        self.created: list[tuple[str, int]] = []

    def create_topics(self, topics: list[Any], request_timeout: float) -> Any:
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        if self.outcome is None:
            self.created += [(t.topic, t.num_partitions) for t in topics]
            future.set_result(None)
        else:
            future.set_exception(self.outcome)
        return {t.topic: future for t in topics}


def lookup(cluster: Cluster, admin: Admin | None = None, partitions: int | None = None) -> Any:
    return TopicLookup(cluster.list_topics, lambda: admin or Admin(), partitions, 0.1)


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The monotonic clock the lookup reads, moved by the test."""
    now = [1_000.0]
    monkeypatch.setattr("outbox_kafka.relay.topic_admin.time.monotonic", lambda: now[0])
    return now


def test_a_topic_found_is_asked_for_once(clock: list[float]) -> None:
    cluster = Cluster(orders=None)
    topics = lookup(cluster)
    assert [topics.problem("orders") for _ in range(3)] == [None, None, None]
    assert cluster.asked == [None]
    assert topics.partition_count("orders") == 2
    assert cluster.asked == [None]  # from the same answer


def test_a_missing_topic_is_said_and_asked_again_after_a_while(clock: list[float]) -> None:
    cluster = Cluster()
    topics = lookup(cluster)
    verdict, reason = topics.problem("orders") or (None, "")
    assert verdict == Verdict.HELD
    assert reason.startswith("UNKNOWN_TOPIC: topic 'orders' does not exist and topic creation")
    assert topics.problem("orders") == (verdict, reason)
    assert cluster.asked == [None, "orders"]
    cluster.topics["orders"] = None  # an operator made it
    clock[0] += MISSING_TOPIC_SECONDS
    assert topics.problem("orders") is None
    assert cluster.asked == [None, "orders", None]


def test_a_topic_not_granted_waits_with_the_brokers_words(clock: list[float]) -> None:
    """Left out of the list of every topic, it is asked for by name: not granted is not
    missing, and is not created."""
    cluster, admin = Cluster(orders=KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)), Admin()
    verdict, reason = lookup(cluster, admin, partitions=3).problem("orders") or (None, "")
    assert admin.created == []
    assert cluster.asked == [None, "orders"]
    assert verdict == Verdict.HELD
    assert reason.startswith("TOPIC_AUTHORIZATION_FAILED: ")
    assert reason.endswith("(topic 'orders'; its events wait)")


def test_after_a_failed_request_lookups_fail_fast_for_a_while(clock: list[float]) -> None:
    """A broker that does not answer is asked once per window, not once per event."""
    cluster = Cluster(orders=None)
    cluster.down = True
    topics = lookup(cluster)
    said = [topics.problem(topic) for topic in ("orders", "orders", "payments")]
    assert {problem and problem[0] for problem in said} == {Verdict.RETRIABLE}
    assert all(p and p[1].startswith("METADATA_UNAVAILABLE: ") for p in said)
    assert topics.partition_count("orders") is None
    assert cluster.asked == [None]
    cluster.down = False
    clock[0] += METADATA_RETRY_SECONDS
    assert topics.problem("orders") is None
    assert cluster.asked == [None, None]


def test_forgetting_every_topic_asks_again_at_once_after_a_failed_request(
    clock: list[float],
) -> None:
    """After a stall, the log relay reads the stream again within the retry window:
    the broker is asked again, not the failure of moments ago repeated."""
    cluster = Cluster(orders=None)
    cluster.down = True
    topics = lookup(cluster)
    assert topics.problem("orders") is not None
    cluster.down = False
    topics.forget()
    assert topics.problem("orders") is None
    assert cluster.asked == [None, None]


def test_forgetting_asks_again(clock: list[float]) -> None:
    cluster = Cluster(orders=None)
    topics = lookup(cluster)
    assert topics.problem("orders") is None
    del cluster.topics["orders"]
    topics.forget("orders")
    assert topics.problem("orders") is not None
    cluster.topics["orders"] = None
    topics.forget()  # every topic, the ones found missing too, at once
    assert topics.problem("orders") is None
    assert cluster.asked == [None, None, "orders", None]


def test_an_admin_client_that_cannot_be_made_is_a_reason_to_wait(clock: list[float]) -> None:
    def admin() -> Any:
        raise KafkaException(KafkaError(KafkaError._INVALID_ARG, "no admin now"))

    topics = TopicLookup(Cluster().list_topics, admin, 3, 0.1)
    verdict, reason = topics.problem("orders") or (None, "")
    assert verdict == Verdict.HELD
    assert reason.startswith("CREATE_TOPIC_FAILED: cannot create topic 'orders': KafkaException")


def test_a_missing_topic_is_made_with_create_topics(clock: list[float]) -> None:
    cluster, admin = Cluster(), Admin()
    topics = lookup(cluster, admin, partitions=3)
    assert topics.problem("orders") is None
    assert topics.problem("orders") is None
    assert admin.created == [("orders", 3)]
    assert cluster.asked == [None, "orders"]


@pytest.mark.parametrize(
    "outcome",
    [
        concurrent.futures.TimeoutError(),
        KafkaException(KafkaError(KafkaError.POLICY_VIOLATION, "no new topics here")),
    ],
)
def test_a_topic_that_cannot_be_made_waits_with_why(
    clock: list[float], outcome: BaseException
) -> None:
    """Even a creation that times out is a reason to wait, not an exception out of
    the relay's step."""
    verdict, reason = lookup(Cluster(), Admin(outcome), partitions=3).problem("orders") or (
        None,
        "",
    )
    assert verdict == Verdict.HELD
    assert reason.startswith("CREATE_TOPIC_FAILED: cannot create topic 'orders': ")
    assert reason.endswith("(its events wait)")
