"""A broker that answers later than the lease: sends time out and are retried; nothing else.

Two relays share the outbox behind a proxy that holds every response from
the broker for longer than the lease (requests still arrive at once). Every
send then times out (the delivery timeout is below the lease) and its events
are retried with backoff. A batch can still outlive its lease when the
producer reports a timeout late; the other relay, or the same relay's next
claim, then takes the keys over and sends the events again. Such a late
outcome must not be recorded (the finish is fenced by the claim token), each
loss must show in ``outbox_leases_lost_total``, and per-key order must hold
in Kafka. A claim read ahead behind a slow send is claimed afresh rather than
sent with the little that is left of its lease, so lost leases are rare here;
``test_a_claim_read_ahead_behind_a_slow_send_is_claimed_afresh_not_sent_late``
and the fencing tests in ``tests/integration`` cover both paths one by one.
"""

from __future__ import annotations

import time
import uuid
from collections import Counter
from typing import Any

import sqlalchemy as sa

from outbox_kafka.demo.embedded import EmbeddedBroker
from outbox_kafka.relay import Relay
from outbox_kafka.relay.metrics import RelayMetrics
from tests.relay_support import (
    RelayThread,
    TcpProxy,
    consume_all,
    delivered_count,
    discarded_count,
    enqueue_bulk,
    make_settings,
    outbox_summary,
    seq_events,
    topic_outbox,
    wait_until,
)
from tests.reliability.harness import (
    Collector,
    RecoveryClock,
    Writer,
    audit,
    check_writer,
    create_topic,
    wait_all_delivered,
)
from tests.reliability.report import seconds, size

LEASE = 3.0


def two_relays(database_url: str, bootstrap: str, name: str, **settings: Any) -> list[RelayThread]:
    """Two relays on one outbox, not started, each with metrics of its own."""
    return [
        RelayThread(
            Relay(
                make_settings(database_url, bootstrap, relay_id=f"{name}-{n}", **settings),
                metrics=RelayMetrics(),
            ),
            name=f"relay-{n}",
        )
        for n in range(2)
    ]


def test_responses_slower_than_the_lease_are_retried_and_lose_nothing(
    engine: sa.Engine, database_url: str, proxied_broker: tuple[TcpProxy, EmbeddedBroker]
) -> None:
    slow_for = seconds(10, 45)
    delay = LEASE + 2
    total = size(3_000, 30_000)
    rate = size(300, 700)
    keys = [f"key-{i:03d}" for i in range(size(40, 200))]
    topic = f"slow-{uuid.uuid4().hex[:10]}"

    proxy, _ = proxied_broker
    bootstrap = f"127.0.0.1:{proxy.port}"
    create_topic(bootstrap, topic, 4)
    relays = two_relays(
        database_url,
        bootstrap,
        "slow",
        lease_seconds=LEASE,
        delivery_timeout_ms=int(LEASE * 800),
        batch_size=200,
    )
    collector = Collector(bootstrap, topic)
    clock = RecoveryClock(engine)
    writer = Writer(engine, topic, keys, total, rate=rate)

    def leases_lost() -> float:
        return sum(
            r.relay.metrics.registry.get_sample_value("outbox_leases_lost_total") or 0.0
            for r in relays
        )

    try:
        for r in relays:
            r.start()
        writer.start()
        # Warm up: every relay has looked up the topic before the broker turns slow.
        wait_until(lambda: all(r.total("delivered") > 0 for r in relays), 60)
        proxy.set_delay(delay)
        slow_from = time.monotonic()
        while time.monotonic() - slow_from < slow_for:
            collector.read(0.5)
        proxy.set_delay(0)
        clock.fault_ended()
        writer.join(600)
        wait_all_delivered(engine, size(120, 600), lambda: outbox_summary(engine))
        recover = clock.worst()
        collector.catch_up(set(writer.committed), 120)
        for r in relays:
            assert r.is_alive() and r.error is None, r.error
    finally:
        writer.stop()
        for r in relays:
            if r.is_alive():
                r.stop(60)
        collector.close()
    check_writer(engine, writer)
    lost_leases = leases_lost()
    assert sum(r.total("retried") for r in relays) > 0, "no send failed: the delay did not bite"
    assert lost_leases == sum(r.total("leases_lost") for r in relays)
    assert delivered_count(engine) == total

    result = audit(engine, collector.generations)
    # wrong_marks empty: no late, fenced outcome overwrote where Kafka put an event.
    result.assert_clean()
    result.row(
        "slow broker",
        recover,
        f"responses held {delay:.0f} s (lease {LEASE:.0f} s) for {slow_for:.0f} s; "
        f"{lost_leases:.0f} leases lost (outbox_leases_lost_total), fenced",
    )


def test_many_discards_behind_a_slow_broker_fit_in_the_lease_and_are_copied_once(
    engine: sa.Engine, database_url: str, proxied_broker: tuple[TcpProxy, EmbeddedBroker]
) -> None:
    """Hundreds of events that can never be sent, each answered 50 ms late by the
    broker: their dead-letter copies go out with the batch, in one round trip, not
    one send each (which took the batch far past its 2 s lease, so the other relay
    took the keys and every event was copied twice). No lease is lost, and the
    dead-letter topic holds exactly one copy of each discarded event."""
    discards = size(300, 1_000)
    lease = 2.0
    topic = f"poisoned-{uuid.uuid4().hex[:10]}"
    dead_letters = f"{topic}-dlq"

    proxy, _ = proxied_broker
    bootstrap = f"127.0.0.1:{proxy.port}"
    create_topic(bootstrap, topic, 2)
    create_topic(bootstrap, dead_letters, 2)
    ids = enqueue_bulk(
        engine, topic_outbox(), seq_events(topic, [f"k{i:04d}" for i in range(discards)], discards)
    )
    with engine.begin() as conn:  # each event's value is no envelope: a permanent failure
        conn.execute(sa.text("UPDATE outbox SET value = convert_to('not json', 'UTF8')"))
    relays = two_relays(
        database_url,
        bootstrap,
        "poisoned",
        lease_seconds=lease,
        delivery_timeout_ms=int(lease * 800),
        dead_letter_topic=dead_letters,
        batch_size=1_000,
    )
    try:
        proxy.set_delay(0.05)
        for r in relays:
            r.start()
        wait_until(lambda: discarded_count(engine) == discards, 120)
        copies = consume_all(bootstrap, dead_letters, discards, timeout=120)
        for r in relays:
            assert r.is_alive() and r.error is None, r.error
    finally:
        for r in relays:
            if r.is_alive():
                r.stop(60)
    assert sum(r.total("leases_lost") for r in relays) == 0
    assert sum(r.total("discarded") for r in relays) == discards
    copied = Counter(record.event_id for record in copies)
    assert set(copied) == {str(i) for i in ids}
    assert max(copied.values()) == 1, copied.most_common(3)
